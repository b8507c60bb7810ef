"""Invariants of the block pool and scheduler under random workloads (hypothesis), with no model."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineConfig
from batchprefill.engine.request import Request, SamplingParams, Status
from batchprefill.engine.scheduler import Scheduler


def check_pool(scheduler: Scheduler) -> None:
    pool = scheduler.pool
    free, reclaimable = set(pool.free), set(pool.reclaimable)
    active = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
    assert len(free) == len(pool.free) and not free & reclaimable and not free & active and not reclaimable & active
    assert len(free) + len(reclaimable) + len(active) == pool.num_blocks  # every block in exactly one bucket
    holders = Counter(b for r in scheduler.running for b in r.block_table)
    assert all(pool.ref_counts[b] == holders[b] for b in range(pool.num_blocks))
    assert all(pool.keys[b] is not None for b in reclaimable)
    assert all(pool.cached[pool.keys[b]] == b for b in reclaimable)
    counts = pool.counts()
    assert (counts.active, counts.reclaimable, counts.free) == (len(active), len(reclaimable), len(free))


workloads = st.fixed_dictionaries({
    "seed": st.integers(0, 10_000),
    "num_requests": st.integers(1, 24),
    "block_size": st.sampled_from([2, 4, 8]),
    "num_blocks": st.integers(12, 64),
    "budget": st.integers(1, 96),
    "max_seqs": st.integers(1, 8),
    "prefix_caching": st.booleans(),
    "reserve_growth": st.booleans(),
})


@settings(max_examples=120, deadline=None)
@given(workloads)
def test_random_workloads_keep_every_invariant(w):
    rng = random.Random(w["seed"])
    size = w["block_size"]
    config = EngineConfig(block_size=size, max_batched_tokens=w["budget"], max_num_seqs=w["max_seqs"],
                          num_blocks=w["num_blocks"], prefix_caching=w["prefix_caching"],
                          reserve_output_blocks=w["reserve_growth"])
    scheduler = Scheduler(BlockPool(w["num_blocks"]), config, ("m",))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 4 * size))] for _ in range(3)]
    capacity = w["num_blocks"] * size
    requests = []
    for i in range(w["num_requests"]):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * size))]
        max_tokens = rng.randrange(1, 6)
        if len(prompt) + max_tokens > capacity:  # could never fit: the engine rejects those up front
            continue
        requests.append(Request(i, prompt, SamplingParams(max_tokens=max_tokens), rng.choice(["", "other"])))
    for request in requests:
        scheduler.add(request)

    finished = Counter()
    for _ in range(5000):
        if not scheduler.has_work():
            break
        step = scheduler.schedule()
        assert step.num_decode_tokens + step.num_prefill_tokens <= w["budget"]
        assert sum(c.num_tokens for c in step.chunks) == step.num_decode_tokens + step.num_prefill_tokens
        assert len(step.chunks) <= w["max_seqs"]
        assert len({id(c.request) for c in step.chunks}) == len(step.chunks)
        for chunk in step.chunks:
            request = chunk.request
            assert request.status is Status.RUNNING
            end = request.num_computed_tokens + chunk.num_tokens
            assert end <= request.num_tokens and len(request.block_table) * size >= end
        check_pool(scheduler)
        scheduler.commit(step)
        for chunk in step.chunks:
            request = chunk.request
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(rng.randrange(50))
                if len(request.output_token_ids) >= request.sampling.max_tokens:
                    scheduler.finish(request)
                    finished[request.request_id] += 1
        check_pool(scheduler)
    assert not scheduler.has_work()
    assert finished == Counter(r.request_id for r in requests)  # every request finished exactly once
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in requests)
    assert not scheduler.in_flight
    if w["reserve_growth"]:
        assert scheduler.preemptions == 0  # admission held every request's ceiling: nothing was recomputed
