"""Invariants of the block pool and scheduler under random workloads (hypothesis), with no model."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineSettings
from batchprefill.engine.request import Request, Status
from batchprefill.engine.scheduler import Scheduler
from batchprefill.sampling_params import SamplingParams


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
    "forks": st.sampled_from(["none", "samples", "choices"]),
})


def with_forks(parent: Request, kind: str, rng: random.Random, next_id: list[int]) -> list[Request]:
    """Children for a parent: n samples of its prompt, or choices that continue it (scored, sampling nothing)."""
    if kind == "samples":
        return [Request(parent.request_id, parent.prompt_token_ids, parent.sampling, parent.namespace,
                        sample_index=s) for s in range(1, rng.randrange(2, 5))]
    if kind == "choices":
        children = []
        for _ in range(rng.randrange(1, 4)):
            next_id[0] += 1
            continuation = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            children.append(Request(next_id[0], parent.prompt_token_ids + continuation, SamplingParams(max_tokens=0),
                                    parent.namespace))
        return children
    return []


def check_copy(scheduler: Scheduler, parent: Request, copy: tuple[int, int]) -> None:
    """A copied block is the parent's partial last block, and its copy belongs to one child alone."""
    source, target = copy
    size = scheduler.block_size
    assert parent.block_table.index(source) == parent.num_prompt_tokens // size
    assert scheduler.pool.ref_counts[target] == 1 and scheduler.pool.keys[target] is None
    assert sum(target in r.block_table for r in scheduler.running) == 1


@settings(max_examples=120, deadline=None)
@given(workloads)
def test_random_workloads_with_forks_keep_every_invariant_and_finish_every_child_once(w):
    rng = random.Random(w["seed"])
    size = w["block_size"]
    engine = EngineSettings(block_size=size, max_batched_tokens=w["budget"], max_num_seqs=w["max_seqs"],
                            prefix_caching=w["prefix_caching"], reserve_output_blocks=w["reserve_growth"])
    scheduler = Scheduler(BlockPool(w["num_blocks"]), engine, ("m",))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 4 * size))] for _ in range(3)]
    capacity = w["num_blocks"] * size
    requests, next_id = [], [10_000]
    for i in range(w["num_requests"]):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * size))]
        max_tokens = rng.randrange(1, 6)
        if len(prompt) + max_tokens > capacity:  # could never fit: the engine rejects those up front
            continue
        if w["forks"] == "choices":
            max_tokens = 0  # a scored context samples nothing: its children score the choices
        request = Request(i, prompt, SamplingParams(max_tokens=max_tokens), rng.choice(["", "other"]))
        request.forks = with_forks(request, w["forks"], rng, next_id)
        if any(c.num_prompt_tokens + c.sampling.max_tokens > capacity for c in request.forks):
            continue
        requests += [request, *request.forks]
        scheduler.add(request)

    def done(request: Request) -> None:
        scheduler.finish(request)
        finished[request.request_id, request.sample_index] += 1

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
            if request.num_computed_tokens != request.num_tokens:
                continue
            children = list(request.forks)
            if children and not request.output_token_ids:  # its prompt is computed: fork
                for copy in scheduler.fork(request):
                    check_copy(scheduler, request, copy)
                for child in children:
                    if child.sampling.max_tokens:  # a sample: its first token came from the parent's logits
                        child.output_token_ids.append(rng.randrange(50))
                        if len(child.output_token_ids) >= child.sampling.max_tokens:
                            done(child)
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                done(request)
                continue
            request.output_token_ids.append(rng.randrange(50))
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                done(request)
        check_pool(scheduler)
    assert not scheduler.has_work()
    # every request and every child finished exactly once, nothing lost under pool pressure
    assert finished == Counter((r.request_id, r.sample_index) for r in requests)
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in requests)
    assert scheduler.fork_slots == 0
    assert not scheduler.prefix_cache.in_flight
    if w["reserve_growth"]:
        assert scheduler.preemptions == 0  # admission held every request's ceiling: nothing was recomputed
