"""Sampling on the real model: seeds, top-k / top-p, stop strings, EOS and max_tokens."""

import torch

from batchprefill.engine.request import Request, SamplingParams
from batchprefill.engine.sampler import _draw, request_generator


def run(engine, prompts, **params):
    requests = [Request(i, list(p), SamplingParams(**params)) for i, p in enumerate(prompts)]
    return {r.request_id: r for r in engine.generate(requests)}


def test_same_seed_same_output_whatever_shares_the_batch(make_engine, chat_prompts):
    params = dict(max_tokens=10, temperature=1.0, top_p=0.95, seed=11)
    together = run(make_engine(), chat_prompts[:4], **params)
    lone = Request(2, list(chat_prompts[2]), SamplingParams(**params))  # same row id, alone in its batch
    alone = {r.request_id: r for r in make_engine().generate([lone])}
    again = run(make_engine(max_batched_tokens=32), chat_prompts[:4], **params)
    assert [together[i].output_token_ids for i in range(4)] == [again[i].output_token_ids for i in range(4)]
    other_seed = run(make_engine(), chat_prompts[:4], **{**params, "seed": 12})
    assert any(other_seed[i].output_token_ids != together[i].output_token_ids for i in range(4))
    assert alone[2].output_token_ids == together[2].output_token_ids


def test_top_k_one_is_greedy(make_engine, chat_prompts):
    greedy = run(make_engine(), chat_prompts[:3], max_tokens=8)
    top1 = run(make_engine(), chat_prompts[:3], max_tokens=8, temperature=0.8, top_k=1, seed=3)
    assert all(greedy[i].output_token_ids == top1[i].output_token_ids for i in range(3))


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])  # the top two carry ~96% of the mass
    generator = request_generator(0, 0, torch.device("cpu"))
    draws = {_draw(logits, 1.0, -1, 0.9, generator) for _ in range(300)}
    assert draws == {0, 1}
    assert {_draw(logits, 1.0, 1, 1.0, generator) for _ in range(20)} == {0}


def test_eos_stops_with_reason_stop_and_max_tokens_with_length(make_engine, chat_prompts):
    done = run(make_engine(), chat_prompts[:1], max_tokens=40)[0]  # "The capital of France is Paris."
    assert done.finish_reason == "stop" and done.output_token_ids[-1] == 2 and "Paris" in done.output_text
    short = run(make_engine(), chat_prompts[:1], max_tokens=3)[0]
    assert short.finish_reason == "length" and len(short.output_token_ids) == 3
    forced = run(make_engine(), chat_prompts[:1], max_tokens=12, ignore_eos=True)[0]
    assert forced.finish_reason == "length" and len(forced.output_token_ids) == 12


def test_stop_string_ends_the_output_before_it(make_engine, chat_prompts):
    free = run(make_engine(), chat_prompts[:1], max_tokens=40)[0]
    assert "France" in free.output_text
    cut = run(make_engine(), chat_prompts[:1], max_tokens=40, stop=("France",))[0]
    assert cut.finish_reason == "stop" and cut.output_text == free.output_text.split("France")[0]
    assert len(cut.output_token_ids) < len(free.output_token_ids)
