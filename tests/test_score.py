"""task=score in the engine against transformers: each choice's log-likelihood after its context, the context
computed once (prefix cache across rows, fork across choices) and never again per choice."""

import torch

from batchprefill.engine.request import Request
from batchprefill.sampling_params import SamplingParams
from batchprefill.tasks.score import score_request

TOLERANCE = 2e-3  # float32 on the CPU
HEADER = "The following are questions about the world, with answers.\n\n"
QUESTIONS = [("The capital of France is", [" Paris", " Berlin", " a city on the river Seine"]),
             ("Bees make", [" honey", " cars", " wax and honey in hives"]),
             ("Two plus two equals", [" four", " five"])]


def hf_loglikelihood(hf_model, context: list[int], choice: list[int]) -> tuple[float, bool]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([context + choice])).logits[0].float()
    rows = logits[len(context) - 1 : len(context) + len(choice) - 1]
    logprobs = rows.log_softmax(-1)[torch.arange(len(choice)), torch.tensor(choice)]
    return float(logprobs.sum()), bool((rows.argmax(-1) == torch.tensor(choice)).all())


def test_scores_equal_transformers_and_each_context_is_computed_once(make_engine, tokenizer, hf_reference):
    contexts = tokenizer.encode_batch([HEADER + q for q, _ in QUESTIONS])
    choices = [[tokenizer.encode_batch([q + c])[0][len(ctx):] for c in cs]
               for ctx, (q, cs) in zip(tokenizer.encode_batch([q for q, _ in QUESTIONS]), QUESTIONS)]
    assert any(len(c) == 1 for cs in choices for c in cs) and any(len(c) > 3 for cs in choices for c in cs)
    engine = make_engine()
    rows = {r.request_id: r for r in engine.generate(
        [score_request(i, ctx, cs) for i, (ctx, cs) in enumerate(zip(contexts, choices))])}
    assert sorted(rows) == [0, 1, 2]
    for i, (ctx, cs) in enumerate(zip(contexts, choices)):
        scores = rows[i].readout
        reference = [hf_loglikelihood(hf_reference, ctx, c) for c in cs]
        assert max(abs(a - b) for a, (b, _) in zip(scores.choice_logprobs(), reference)) < TOLERANCE
        assert scores.is_greedy() == [greedy for _, greedy in reference]
        assert scores.best_choice() == max(range(len(cs)), key=lambda j: reference[j][0])
        assert rows[i].num_row_prompt_tokens == len(ctx) + sum(map(len, cs))
    plain = make_engine()  # the contexts alone, as prompts: what computing each of them once costs
    list(plain.generate([Request(i, ctx, SamplingParams(max_tokens=1)) for i, ctx in enumerate(contexts)]))
    choice_positions = sum(len(c) - 1 for cs in choices for c in cs)  # a choice's last token needs no KV
    assert engine.counters.prefill_tokens == plain.counters.prefill_tokens + choice_positions
    computed = sum(r.num_row_prompt_tokens - r.num_cached_tokens for r in rows.values())
    assert computed == engine.counters.prefill_tokens
