"""Sampling on the real model: seeds, top-k / top-p, stop strings, EOS and max_tokens."""

import numpy as np
import torch

from batchprefill.engine.request import Request
from batchprefill.engine.sampler import SamplingBatch, draw, request_key, sample, uniforms
from batchprefill.sampling_params import SamplingParams


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
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0]).expand(300, 5)  # the top two carry ~96% of the mass
    u = torch.from_numpy(uniforms(np.full(300, request_key(0, 0), dtype=np.uint64), np.arange(300)))
    ones, nucleus = torch.ones(300), torch.full((300,), 0.9)
    assert set(draw(logits, ones, torch.full((300,), -1), nucleus, u).tolist()) == {0, 1}
    assert set(draw(logits, ones, torch.ones(300, dtype=torch.int32), ones, u).tolist()) == {0}
    assert set(draw(logits, ones, torch.full((300,), -1), ones, u).tolist()) - {0, 1}  # without it, the tail too


def test_draws_follow_the_distribution_one_uniform_per_row():
    """Inverse-CDF sampling with p = softmax([0, ln 3]) = (0.25, 0.75): 4,000 draws land within 3 sigma."""
    logits = torch.tensor([0.0, float(np.log(3.0))]).expand(4000, 2)
    u = torch.from_numpy(uniforms(np.arange(4000, dtype=np.uint64), np.zeros(4000)))
    share = draw(logits, torch.ones(4000), torch.full((4000,), -1), torch.ones(4000), u).float().mean().item()
    assert abs(share - 0.75) < 3 * (0.75 * 0.25 / 4000) ** 0.5


def test_a_mixed_batch_samples_greedy_and_seeded_rows_in_one_call():
    logits = torch.tensor([[0.0, 9.0, 1.0], [3.0, 0.0, 2.9], [0.0, 0.0, 0.0]])
    batch = SamplingBatch(temperature=np.array([0.0, 0.0, 1.0], np.float32), top_k=np.array([-1, -1, -1], np.int32),
                          top_p=np.ones(3, np.float32), keys=np.array([1, 2, 3], np.uint64),
                          counters=np.array([0, 5, 7]))
    tokens = sample(logits, batch)
    assert tokens[:2].tolist() == [1, 0]  # the greedy rows take the argmax
    again = sample(logits, batch)
    assert tokens.tolist() == again.tolist()  # the seeded row's draw depends only on its key and counter


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


def test_a_full_context_ends_with_length_in_the_plain_loop_and_the_per_row_one(make_engine, chat_prompts):
    """A context of prompt + 5 tokens ends a 40-token request after 5 tokens with reason length, both in the
    tight loop of a plain step and in the per-row loop a job with logprobs takes, with the same tokens."""
    outputs = []
    for params in (dict(), dict(logprobs=1)):
        engine = make_engine()
        engine.max_positions = len(chat_prompts[0]) + 5
        done = run(engine, chat_prompts[:1], max_tokens=40, ignore_eos=True, **params)[0]
        assert done.finish_reason == "length" and len(done.output_token_ids) == 5
        outputs.append(done.output_token_ids)
    assert outputs[0] == outputs[1]
