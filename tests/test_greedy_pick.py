"""The fused greedy pick: the LM head picks each row's token chunk by chunk, without the full logits."""

import numpy as np
import pytest
import torch

from batchprefill.engine.request import Request, with_samples
from batchprefill.kernels.linear import Linear
from batchprefill.model.lm_head import VOCAB_CHUNK, LMHead
from batchprefill.sampling_params import SamplingParams


def pick(values: list[float], chunk: int = 4) -> int:
    """The fused pick over one row whose logits are `values` (hidden size 1, hidden value 1: logits = weight)."""
    head = LMHead(torch.tensor(values, dtype=torch.float32)[:, None], chunk=chunk)
    return int(head.greedy_tokens(torch.ones(1, 1))[0])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("values, expected", [
    ([0, 0, 0, 7, 7, 0, 0, 0, 0, 0], 3),  # equal maxima at 3 (chunk 0's last) and 4 (chunk 1's first): the first
    ([7, 0, 0, 0, 0, 0, 0, 0, 7, 0], 0),  # equal maxima in the first and the last (partial) chunk
    ([0, 6, 0, 6, 0, 0, 0, 0, 0, 0], 1),  # equal maxima inside one chunk
    ([0, 0, 0, 7, 7.5, 0, 0, 0, 7.5, 0], 4),  # a later chunk's larger value wins, then ties to its first
    ([0, 0, 0, 0, 0, 0, 0, 0, 0, 9], 9),  # the maximum alone in the last, partial chunk
    ([9, 0, 0, 0, 0, NAN, 0, 0, NAN, 0], 5),  # a NaN is the maximum, the first NaN wins (numpy's argmax)
    ([0, NAN, 0, 0, 9, 0, 0, 0, 0, 0], 1),  # a NaN in an earlier chunk stays ahead of a later larger number
    ([-INF] * 10, 0),  # nothing above -inf: index 0, as argmax
])
def test_the_pick_over_chunks_of_four_is_numpys_argmax_ties_to_the_first(values, expected):
    assert int(np.argmax(np.array(values, np.float32))) == expected  # the reference agrees with the worked answer
    assert pick(values) == expected


def tied_head(weight: torch.Tensor, ties: list[tuple[int, int]]) -> tuple[LMHead, torch.Tensor]:
    """A head whose columns in each pair are the same vector, 10x longer than any other, and hidden rows along
    each pair's vector: for row i the pair ties[i] holds the row's maximum, twice, exactly."""
    generator = torch.Generator().manual_seed(7)
    weight = weight.clone()
    longest = weight.norm(dim=1).max()
    directions = torch.nn.functional.normalize(torch.randn(len(ties), weight.shape[1], generator=generator), dim=1)
    for direction, pair in zip(directions, ties):
        weight[list(pair)] = 10 * longest * direction
    return LMHead(weight), 3 * directions


def test_on_smollm2s_lm_head_the_fused_pick_equals_argmax_of_the_full_logits_ties_across_chunks_to_the_first(
        loaded_model):
    """SmolLM2's real head (49,152 x 576, 12 chunks of 4,096): 64 random rows pick exactly numpy's argmax of the
    full logits, and rows whose maximum is tied between columns 4,095 | 4,096 (a chunk boundary), 8,191 | 40,000
    (chunks 1 and 9) and 4,100 | 4,200 (inside chunk 1) pick 4,095, 8,191 and 4,100."""
    model = loaded_model.model
    assert VOCAB_CHUNK == 4096 and model.lm_head.vocab == 49152 and len(model.lm_head.parts) == 12
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, model.config.hidden_size, generator=generator)
    full = model.lm_head.logits(hidden)
    assert torch.equal(full, Linear(model.embed)(hidden))  # the same logits as the unchunked head gave
    assert model.lm_head.greedy_tokens(hidden).tolist() == full.numpy().argmax(-1).tolist()

    ties = [(4095, 4096), (8191, 40000), (4100, 4200)]
    head, rows = tied_head(model.embed, ties)
    logits = head.logits(rows)
    for row, (first, second) in enumerate(ties):  # the ties are real: equal values, and the row's maximum
        assert logits[row, first] == logits[row, second] == logits[row].max()
    assert logits.numpy().argmax(-1).tolist() == [4095, 8191, 4100]
    assert head.greedy_tokens(rows).tolist() == [4095, 8191, 4100]


def test_a_softcapped_head_picks_the_argmax_of_the_capped_logits():
    """Gemma's final softcap (30 tanh(x / 30)): logits 0, 300, 301 cap to 0, 30 * tanh(10) and 30 * tanh(10.03),
    which float32 rounds to the same 30.0, so argmax over the capped logits is 1, not the raw argmax 2: the pick
    applies the cap too (chunks of 2: the tie straddles a boundary)."""
    head = LMHead(torch.tensor([[0.0], [300.0], [301.0]]), softcap=30.0, chunk=2)
    capped = head.logits(torch.ones(1, 1))
    assert capped[0, 1] == capped[0, 2] == 30.0
    assert head.greedy_tokens(torch.ones(1, 1)).tolist() == [1]


def run(engine, prompts, **params):
    requests = [Request(i, list(p), SamplingParams(max_tokens=6 + i % 7, **params)) for i, p in enumerate(prompts)]
    return {r.request_id: r for r in engine.generate(requests)}


def counting(monkeypatch, runner) -> list[int]:
    """How many steps the runner picked greedily without the logits (the model's fused pick), how many went
    through the logits, and how many forward passes ran at all (every pass makes final hidden states; a step of
    prefill chunks where no row samples yet runs no LM head after them)."""
    calls = [0, 0, 0]
    model, forward, final_hidden = runner.model, runner.model.forward, runner.model.final_hidden

    def spy(*args, greedy=False, **kwargs):
        calls[0 if greedy else 1] += 1
        return forward(*args, greedy=greedy, **kwargs)

    def hidden_spy(*args, **kwargs):
        calls[2] += 1
        return final_hidden(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    monkeypatch.setattr(model, "final_hidden", hidden_spy)
    return calls


def test_a_greedy_engine_run_picks_in_the_lm_head_and_gives_the_unfused_runs_tokens(make_engine, chat_prompts,
                                                                                    monkeypatch):
    """Ten chat prompts, 6 to 12 greedy tokens each, 32-token steps (prefill chunks and decodes mixed): every
    step where a row samples takes the fused pick, a step of the first prompt's first 32 tokens (nothing samples)
    runs no LM head, and the tokens and finish reasons equal a run that samples from the logits."""
    unfused = make_engine(max_batched_tokens=32)
    unfused.runner.fused_greedy = False
    reference = run(unfused, chat_prompts)
    fused = make_engine(max_batched_tokens=32)
    calls = counting(monkeypatch, fused.runner)
    results = run(fused, chat_prompts)
    steps = len(fused.counters.steps)
    assert calls[2] == steps and calls[1] == 0 and 0 < calls[0] < steps  # 16 of 17 here: the first step samples nothing
    assert len(results) == 10
    for i in range(10):
        assert results[i].output_token_ids == reference[i].output_token_ids
        assert len(results[i].output_token_ids) == 6 + i % 7 or results[i].finish_reason == "stop"
        assert results[i].finish_reason == reference[i].finish_reason


@pytest.mark.parametrize("params", [dict(logprobs=1), dict(temperature=0.8, seed=3)])
def test_a_job_that_reads_the_logits_never_takes_the_fused_pick(make_engine, chat_prompts, monkeypatch, params):
    """With logprobs asked, or every row drawing at temperature 0.8, no step picks in the LM head."""
    engine = make_engine()
    calls = counting(monkeypatch, engine.runner)
    run(engine, chat_prompts[:3], **params)
    assert calls[0] == 0 and calls[1] == len(engine.counters.steps) > 0


def test_greedy_rows_beside_a_drawing_row_or_a_forking_parent_keep_their_tokens(make_engine, chat_prompts,
                                                                                monkeypatch):
    """Rows 0-3 greedy, row 4 drawing at temperature 0.8 (6 tokens), then row 5 with n=2: the steps where row 4
    samples or row 5 forks go through the logits, the others pick in the head, and every row's tokens equal the
    unfused run's."""
    def requests():
        out = [Request(i, list(chat_prompts[i]), SamplingParams(max_tokens=6)) for i in range(4)]
        out.append(Request(4, list(chat_prompts[4]), SamplingParams(max_tokens=6, temperature=0.8, seed=1)))
        out.append(with_samples(Request(5, list(chat_prompts[5]), SamplingParams(max_tokens=10, n=2))))
        return out

    unfused = make_engine(max_batched_tokens=64)
    unfused.runner.fused_greedy = False
    reference = {(r.request_id, r.sample_index): r.output_token_ids for r in unfused.generate(requests())}
    fused = make_engine(max_batched_tokens=64)
    calls = counting(monkeypatch, fused.runner)
    results = {(r.request_id, r.sample_index): r.output_token_ids for r in fused.generate(requests())}
    assert results == reference and len(results) == 7
    assert calls[0] > 0 and calls[1] >= 6  # row 4's six draws went through the logits, with the fork's step
