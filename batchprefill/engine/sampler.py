"""Next-token choice for a whole step in one pass: greedy rows by argmax, the others by temperature, top-k and
top-p given as per-row vectors, each row drawing from its own request's random stream.

A request's stream is counter-based: the draw for its n-th output token is a hash of (the request's key, n),
and the key depends only on the job's seed, the row's id and its sample index. So a row gets the same tokens
whatever shares its batch, after a resume and on another shard, and the batch needs no per-row generator:
one uniform per row, turned into a token by inverse-CDF sampling over the filtered distribution. The old
per-row loop (topk, sort, softmax, multinomial and a host sync per row) is gone; there is one host copy per
step, of the chosen tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def request_key(seed: int, request_id: int, sample_index: int = 0) -> int:
    """The 64-bit key of a request's random stream: the job's seed, the row and the sample, nothing else."""
    digest = hashlib.blake2b(f"{seed}:{request_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One draw in [0, 1) per row: splitmix64 of (key, counter), the counter being the output index."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64) + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """The sampled rows' settings, one entry per logits row."""

    temperature: np.ndarray  # float32; 0 = greedy
    top_k: np.ndarray  # int32; <= 0 = off
    top_p: np.ndarray  # float32; 1 = off
    keys: np.ndarray  # uint64 stream keys
    counters: np.ndarray  # int64: outputs each row already has (the index of the token drawn now)


def fork_sampling(requests: list) -> SamplingBatch:
    """The settings of requests that draw their first token from a parent's logits (forked samples): each from
    its own stream, key (seed, id, sample index), at counter 0."""
    params = [r.sampling for r in requests]
    return SamplingBatch(np.array([p.temperature for p in params], np.float32),
                         np.array([p.top_k for p in params], np.int32), np.array([p.top_p for p in params], np.float32),
                         np.array([request_key(p.seed, r.request_id, r.sample_index) for p, r in zip(params, requests)],
                                  np.uint64), np.zeros(len(requests), np.int64))


Argmax = Callable[[torch.Tensor], torch.Tensor]


def numpy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax of CPU logits by numpy, whose SIMD loop is about 4x faster than torch's argmax over a 49k
    vocabulary (255 x 49,152 float32: 15 against 65 ms on a loaded 2-core machine, the same first-maximum
    indices); on benchmarks/cpu/host_overhead.py it was most of the sampler's time."""
    return torch.from_numpy(logits.numpy().argmax(-1))


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax_for(device: torch.device) -> Argmax:
    """The greedy pick for logits on this device, chosen once by the runner."""
    return numpy_argmax if device.type == "cpu" else torch_argmax


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = torch_argmax) -> np.ndarray:
    """The next token of every row `[R]`, as a host array."""
    return sample_on_device(logits, batch, argmax).cpu().numpy()


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = torch_argmax) -> torch.Tensor:
    """The next token of every row `[R]`, int64 on the logits' device: the overlapped loop reads them a step later."""
    tokens = argmax(logits)
    drawn = np.flatnonzero(batch.temperature > 0)
    if drawn.size:
        device = logits.device
        rows = torch.from_numpy(drawn).to(device)
        as_tensor = lambda values: torch.from_numpy(np.ascontiguousarray(values[drawn])).to(device)  # noqa: E731
        top_k = batch.top_k[drawn]
        limited = top_k[(top_k > 0) & (top_k < logits.shape[-1])]
        tokens[rows] = draw(logits[rows], as_tensor(batch.temperature), as_tensor(batch.top_k),
                            as_tensor(batch.top_p), torch.from_numpy(uniforms(batch.keys[drawn],
                                                                               batch.counters[drawn])).to(device),
                            largest_k=int(limited.max()) if limited.size else 0,
                            nucleus=bool((batch.top_p[drawn] < 1).any()))
    return tokens


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         u: torch.Tensor, *, largest_k: int | None = None, nucleus: bool | None = None) -> torch.Tensor:
    """Tokens `[R]` drawn from softmax(logits / temperature) restricted to each row's top-k and top-p nucleus,
    at the quantile `u` of each row's distribution (inverse-CDF sampling: one uniform per row). `largest_k` (the
    largest top-k in force, 0: none) and `nucleus` (whether any top-p is below 1), when the caller knows them from
    the host's copies, spare reading them back from the device: the overlapped loop must not wait on it here."""
    scores = logits.float() / temperature[:, None].float()
    vocab = scores.shape[-1]
    limited = (top_k > 0) & (top_k < vocab)
    if largest_k is None:
        largest_k = int(top_k[limited].max()) if bool(limited.any()) else 0
    if largest_k:
        kth = scores.topk(largest_k, dim=-1).values.gather(1, (top_k.clamp(1, largest_k) - 1).long()[:, None])
        kth = torch.where(limited[:, None], kth, torch.full_like(kth, float("-inf")))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if nucleus if nucleus is not None else bool((top_p < 1).any()):
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p[:, None].float()  # past the nucleus; the top token always stays
        scores = torch.empty_like(scores).scatter_(1, order, ordered.masked_fill(outside, float("-inf")))
    cdf = scores.softmax(-1).cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
