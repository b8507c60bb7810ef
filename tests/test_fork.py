"""n samples per prompt through fork, on the real model: each forked sample is the sample its seed gives when
run alone (so the copied partial block holds the parent's KV), and the prompt is computed once."""

from batchprefill.engine.request import Request, with_samples
from batchprefill.sampling_params import SamplingParams

PARAMS = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)


def outputs(engine, prompts, **params) -> dict[tuple[int, int], list[int]]:
    requests = [with_samples(Request(i, list(p), SamplingParams(**{**PARAMS, **params}))) for i, p in
                enumerate(prompts)]
    return {(r.request_id, r.sample_index): r.output_token_ids for r in engine.generate(requests)}


def test_three_forked_samples_equal_each_sample_run_alone_and_compute_the_prompt_once(make_engine, chat_prompts):
    prompts = chat_prompts[:2]  # 39 and 41 tokens: each ends in a partial 16-token block, which forks copy
    engine = make_engine()
    forked = outputs(engine, prompts, n=3)
    assert sorted(forked) == [(i, s) for i in range(2) for s in range(3)]
    assert all(len({tuple(forked[i, s]) for s in range(3)}) > 1 for i in range(2))  # the samples differ
    alone = {}
    for i, prompt in enumerate(prompts):
        for s in range(3):
            request = Request(i, list(prompt), SamplingParams(**PARAMS), sample_index=s)
            alone[i, s] = next(iter(make_engine().generate([request]))).output_token_ids
    assert forked == alone
    single = make_engine()
    outputs(single, prompts, n=1)
    assert engine.counters.prefill_tokens <= 1.05 * single.counters.prefill_tokens
    # 55 of the prompts' 71 tokens, for 3 samples as for 1: the shared system prompt is cached, the rest computed once
    assert engine.counters.prefill_tokens == single.counters.prefill_tokens == 55


def test_forks_under_pool_pressure_finish_with_the_same_samples(make_engine, chat_prompts):
    """8 blocks of 16 tokens: three 37-token prompts with 3 samples of 30 tokens need 11 blocks each, so children
    wait for a block and samples are preempted (2 preemptions without reserved growth); every sample still
    comes out once, as with a roomy pool."""
    prompts = chat_prompts[:3]
    roomy = outputs(make_engine(), prompts, n=3, max_tokens=30)
    for reserve in (True, False):
        tight = make_engine(num_blocks=8, max_num_seqs=4, reserve_output_blocks=reserve)
        assert outputs(tight, prompts, n=3, max_tokens=30) == roomy
        assert reserve or tight.scheduler.preemptions > 0
