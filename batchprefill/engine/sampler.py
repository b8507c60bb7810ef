"""Next-token choice: greedy, or temperature with top-k / top-p, each request on its own seeded stream."""

from __future__ import annotations

import torch

from batchprefill.engine.request import Request


def request_generator(seed: int, request_id: int, device: torch.device) -> torch.Generator:
    """A stream that depends only on the job's seed and the row, never on what else shares the batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + request_id) % (2**63))
    return generator


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    for row, request in enumerate(requests):
        params = request.sampling
        if params.greedy:
            continue
        if request.generator is None:
            request.generator = request_generator(params.seed, request.request_id, logits.device)
        tokens[row] = _draw(logits[row], params.temperature, params.top_k, params.top_p, request.generator)
    return tokens


def _draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    scores = logits.float() / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scores.sort(descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # tokens past the nucleus (the top one always stays)
        scores = scores.scatter(0, order[outside], float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
