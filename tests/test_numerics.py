"""Numerical truth: our forward pass and engine against transformers, and chunked against whole prefill.

Chunked prefill equals monolithic prefill only in exact arithmetic, so logits are compared within a
stated tolerance and greedy tokens are compared over many prompts.
"""

import torch

from batchprefill.engine.request import Request
from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.sampling_params import SamplingParams

LOGIT_TOLERANCE = 2e-3  # float32 on the CPU: differences come only from summation order


def prefill_logits(model, token_ids: list[int], chunk: int, block_size: int = 16) -> torch.Tensor:
    """Logits at every prompt position, computing the prompt `chunk` tokens at a time on a paged cache."""
    cfg = model.config
    num_blocks = cdiv(len(token_ids), block_size)
    table = torch.randperm(num_blocks + 3)[:num_blocks].to(torch.int32)  # blocks in shuffled order
    shape = (num_blocks + 3, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    out = []
    for start in range(0, len(token_ids), chunk):
        stop = min(start + chunk, len(token_ids))
        span = torch.arange(start, stop)
        meta = AttentionMetadata(
            query_start=torch.tensor([0, stop - start], dtype=torch.int32),
            seq_lens=torch.tensor([stop], dtype=torch.int32), block_tables=table[None],
            slot_mapping=table[span // block_size].long() * block_size + span % block_size,
            query_lens_host=[stop - start], seq_lens_host=[stop],
        )
        out.append(model(torch.tensor(token_ids[start:stop]), span, caches, meta, torch.arange(stop - start)))
    return torch.cat(out)


def test_forward_matches_transformers_and_chunking_stays_within_tolerance(loaded_model, hf_reference, chat_prompts):
    model = loaded_model.model
    ids = chat_prompts[4] + chat_prompts[5][30:]  # ~70 tokens, not a multiple of any chunk
    whole = prefill_logits(model, ids, chunk=len(ids))
    with torch.no_grad():
        reference = hf_reference(torch.tensor([ids])).logits[0].float()
    assert (whole - reference).abs().max().item() < LOGIT_TOLERANCE
    assert torch.equal(whole.argmax(-1), reference.argmax(-1))
    for chunk in (16, 64):
        chunked = prefill_logits(model, ids, chunk=chunk)
        assert (chunked - whole).abs().max().item() < LOGIT_TOLERANCE, f"chunk {chunk}"


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=2, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def generate(engine, prompts: list[list[int]], max_tokens: int) -> dict[int, Request]:
    requests = [Request(i, list(p), SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    return {r.request_id: r for r in engine.generate(requests)}


def test_greedy_tokens_match_transformers_on_ten_prompts(make_engine, hf_reference, chat_prompts):
    engine = make_engine(block_size=16, max_batched_tokens=64)  # chunked prefill, batched decode, reuse
    ours = generate(engine, chat_prompts, max_tokens=12)
    assert sum(r.num_cached_tokens for r in ours.values()) > 0
    for i, prompt in enumerate(chat_prompts):
        assert ours[i].output_token_ids == hf_greedy(hf_reference, prompt, 12), f"prompt {i}"


def test_output_is_the_same_whether_the_prefix_was_cached_or_computed(make_engine, chat_prompts):
    cached = generate(make_engine(prefix_caching=True, max_batched_tokens=48), chat_prompts, max_tokens=10)
    computed = generate(make_engine(prefix_caching=False, max_batched_tokens=4096), chat_prompts, max_tokens=10)
    assert sum(r.num_cached_tokens for r in cached.values()) >= 9 * 16
    assert all(r.num_cached_tokens == 0 for r in computed.values())
    for i in range(len(chat_prompts)):
        assert cached[i].output_token_ids == computed[i].output_token_ids
        assert cached[i].output_text == computed[i].output_text


def test_a_pool_under_pressure_gives_the_same_tokens_with_or_without_preemption(make_engine, chat_prompts):
    roomy = generate(make_engine(num_blocks=512), chat_prompts[:6], max_tokens=16)
    for reserve in (True, False):
        engine = make_engine(num_blocks=14, block_size=8, max_batched_tokens=32, reserve_output_blocks=reserve)
        tight = generate(engine, chat_prompts[:6], max_tokens=16)
        if reserve:
            assert engine.scheduler.preemptions == 0 and engine.pool.evictions > 0
        else:
            assert engine.scheduler.preemptions > 0
        for i in range(6):
            assert tight[i].output_token_ids == roomy[i].output_token_ids


def test_a_request_that_can_never_fit_the_pool_is_an_error_and_the_rest_run(make_engine, chat_prompts):
    engine = make_engine(num_blocks=8, block_size=8)  # 64 slots: prompts of ~35 tokens + 16 fit, + 40 do not
    done = {r.request_id: r for r in engine.generate(
        [Request(0, list(chat_prompts[0]), SamplingParams(max_tokens=40)),
         Request(1, list(chat_prompts[1]), SamplingParams(max_tokens=16))])}
    assert done[0].finish_reason == "error" and "engine.kv_cache_tokens" in done[0].error
    assert done[1].finish_reason in ("stop", "length") and done[1].error is None
