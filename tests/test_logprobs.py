"""sampling.logprobs=k against transformers: the raw log-softmax of every output token and the k most likely."""

import torch

from batchprefill.engine.request import Request
from batchprefill.sampling_params import SamplingParams


def test_logprobs_equal_transformers_log_softmax_at_every_output_position(make_engine, chat_prompts, hf_reference):
    params = [SamplingParams(max_tokens=6, logprobs=3), SamplingParams(max_tokens=6, logprobs=2, temperature=0.7,
                                                                       top_p=0.9, seed=4), SamplingParams(max_tokens=4)]
    requests = [Request(i, list(chat_prompts[i]), p) for i, p in enumerate(params)]
    done = {r.request_id: r for r in make_engine().generate(requests)}
    assert done[2].output_logprobs == [] and done[2].output_top_logprobs == []  # not asked: none kept
    for i in (0, 1):
        request, k = done[i], params[i].logprobs
        prompt, output = request.prompt_token_ids, request.output_token_ids
        with torch.no_grad():
            logits = hf_reference(torch.tensor([prompt + output])).logits[0].float()
        reference = logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(-1)
        chosen = reference[torch.arange(len(output)), torch.tensor(output)]
        assert len(request.output_logprobs) == len(output) == 6
        assert (torch.tensor(request.output_logprobs) - chosen).abs().max() < 1e-3
        top = reference.topk(k, dim=-1)
        assert [[t for t, _ in entry] for entry in request.output_top_logprobs] == top.indices.tolist()
        ours = torch.tensor([[v for _, v in entry] for entry in request.output_top_logprobs])
        assert (ours - top.values).abs().max() < 1e-3
