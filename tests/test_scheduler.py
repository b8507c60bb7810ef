"""Worked cases of prefix reuse, chunking and fill-once-per-group, run through the real block pool and scheduler
(no model): a 2,500-token shared prefix, a token changed at index 5, a 2,048-token prompt under a 512 budget."""

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineSettings
from batchprefill.engine.request import Request, Status
from batchprefill.engine.scheduler import Scheduler
from batchprefill.sampling_params import SamplingParams


def make_scheduler(num_blocks=1024, block_size=16, budget=4096, max_seqs=256, reserve_growth=True) -> Scheduler:
    settings = EngineSettings(block_size=block_size, max_batched_tokens=budget, max_num_seqs=max_seqs,
                              reserve_output_blocks=reserve_growth)
    return Scheduler(BlockPool(num_blocks), settings, ("model", "float32"))


def run_to_completion(scheduler: Scheduler, request: Request) -> None:
    """Prefill a request fully, sample one token, and finish it: its full blocks stay cached."""
    scheduler.add(request)
    while request.num_computed_tokens < request.num_tokens:
        scheduler.commit(scheduler.schedule())
    request.output_token_ids.append(7)
    scheduler.finish(request)


def first_chunk(scheduler: Scheduler, request: Request) -> tuple[int, int]:
    """(cached tokens, tokens computed in the first step) for a request admitted alone."""
    scheduler.add(request)
    step = scheduler.schedule()
    (chunk,) = [c for c in step.chunks if c.request is request]
    return request.num_cached_tokens, chunk.num_tokens


def test_shared_2500_of_3000_reuses_2496_and_computes_504():
    scheduler = make_scheduler()
    base = list(range(1, 2501))
    run_to_completion(scheduler, Request(0, base, SamplingParams()))
    query = base + list(range(5000, 5500))
    assert first_chunk(scheduler, Request(1, query, SamplingParams())) == (2496, 504)


def test_a_token_changed_at_index_5_stops_all_reuse():
    scheduler = make_scheduler()
    original = list(range(100, 164))
    run_to_completion(scheduler, Request(0, original, SamplingParams()))
    mutated = list(original)
    mutated[5] = 99_999
    assert first_chunk(scheduler, Request(1, mutated, SamplingParams())) == (0, 64)
    # the unchanged prompt still hits: the cache itself was fine
    assert first_chunk(scheduler, Request(2, list(original), SamplingParams()))[0] == 48


def test_another_namespace_gets_no_reuse():
    scheduler = make_scheduler()
    base = list(range(1, 2501))
    run_to_completion(scheduler, Request(0, base, SamplingParams()))
    assert first_chunk(scheduler, Request(1, base, SamplingParams(), namespace="tenant-b")) == (0, 2500)


def test_a_full_hit_still_computes_the_last_block():
    scheduler = make_scheduler()
    prompt = list(range(1, 65))  # exactly four blocks
    run_to_completion(scheduler, Request(0, prompt, SamplingParams()))
    assert first_chunk(scheduler, Request(1, list(prompt), SamplingParams())) == (48, 16)


def start_decodes(scheduler: Scheduler, count: int) -> list[Request]:
    decodes = [Request(i, [i + 1] * 20, SamplingParams()) for i in range(count)]
    for request in decodes:
        scheduler.add(request)
    scheduler.commit(scheduler.schedule())
    for request in decodes:
        request.output_token_ids.append(3)
        assert request.is_decoding
    return decodes


def test_budget_512_four_decodes_and_a_2048_prompt_chunks_508_x4_then_16():
    scheduler = make_scheduler(budget=512)
    decodes = start_decodes(scheduler, 4)
    prompt = Request(99, list(range(10_000, 12_048)), SamplingParams())
    scheduler.add(prompt)
    chunks = []
    while prompt.num_computed_tokens < prompt.num_tokens:
        step = scheduler.schedule()
        assert step.num_decode_tokens == 4
        assert step.num_decode_tokens + step.num_prefill_tokens <= 512
        chunks.append(next(c.num_tokens for c in step.chunks if c.request is prompt))
        scheduler.commit(step)
        for request in decodes:
            request.output_token_ids.append(3)
    assert chunks == [508, 508, 508, 508, 16]


def test_decodes_filling_the_budget_make_prefill_wait_then_resume():
    scheduler = make_scheduler(budget=4)
    decodes = start_decodes_under_budget(scheduler)
    prompt = Request(99, list(range(500, 540)), SamplingParams())
    scheduler.add(prompt)
    for _ in range(3):
        step = scheduler.schedule()
        assert [c.request for c in step.chunks] == decodes
        assert prompt.status is Status.WAITING and prompt.num_computed_tokens == 0
        scheduler.commit(step)
        for request in decodes:
            request.output_token_ids.append(3)
    for request in decodes[:2]:
        scheduler.finish(request)
    step = scheduler.schedule()
    assert step.num_decode_tokens == 2 and step.num_prefill_tokens == 2
    assert any(c.request is prompt for c in step.chunks)
    assert scheduler.preemptions == 0


def start_decodes_under_budget(scheduler: Scheduler) -> list[Request]:
    """Four one-token prompts: they fit a budget of four and all become decodes."""
    decodes = [Request(i, [i + 1], SamplingParams()) for i in range(4)]
    for request in decodes:
        scheduler.add(request)
    scheduler.commit(scheduler.schedule())
    for request in decodes:
        request.output_token_ids.append(3)
    return decodes


def test_a_group_fills_its_shared_prefix_once():
    scheduler = make_scheduler(budget=4096)
    shared = list(range(1, 97))  # six blocks shared by the whole group
    group = [Request(i, shared + [1000 + i] * 10, SamplingParams()) for i in range(8)]
    for request in group:
        scheduler.add(request)
    first = scheduler.schedule()
    assert [c.request for c in first.chunks] == [group[0]]  # the others wait for the prefix
    scheduler.commit(first)
    group[0].output_token_ids.append(3)
    second = scheduler.schedule()
    followers = [c for c in second.chunks if c.request is not group[0]]
    assert len(followers) == 7
    assert all(c.request.num_cached_tokens == 96 and c.num_tokens == 10 for c in followers)


def test_without_reservation_the_newest_request_is_preempted_when_the_pool_runs_out():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, reserve_growth=False)
    old = Request(0, [1] * 7, SamplingParams())
    new = Request(1, [2] * 7, SamplingParams())
    scheduler.add(old)
    scheduler.add(new)
    scheduler.commit(scheduler.schedule())  # each holds two blocks: the pool is full
    for request in (old, new):
        request.output_token_ids.append(5)
    scheduler.commit(scheduler.schedule())  # both decode into the free slot of their second block
    for request in (old, new):
        request.output_token_ids.append(5)
    step = scheduler.schedule()  # the old one needs a third block: the new one gives way
    assert [c.request for c in step.chunks] == [old]
    assert new.status is Status.WAITING and new.num_computed_tokens == 0
    assert scheduler.preemptions == 1
    assert len(old.block_table) == 3


def test_with_reservation_a_request_waits_until_its_outputs_fit_and_nothing_is_preempted():
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    old = Request(0, [1] * 7, SamplingParams(max_tokens=5))  # up to 12 tokens: three blocks
    new = Request(1, [2] * 7, SamplingParams(max_tokens=9))  # up to 16 tokens: four blocks
    scheduler.add(old)
    scheduler.add(new)
    step = scheduler.schedule()
    assert [c.request for c in step.chunks] == [old] and new.status is Status.WAITING
    scheduler.commit(step)
    while old.status is Status.RUNNING:
        old.output_token_ids.append(5)
        if len(old.output_token_ids) == old.sampling.max_tokens:
            scheduler.finish(old)
            break
        scheduler.commit(scheduler.schedule())
    assert scheduler.preemptions == 0 and len(old.block_table) == 0
    step = scheduler.schedule()
    assert [c.request for c in step.chunks] == [new]


def test_keys_copied_from_a_neighbour_sharing_3_of_5_blocks_equal_keys_hashed_alone():
    """Two 80-token prompts (5 blocks of 16) that differ at token 50, in block 3: the order stage counts 3 shared
    blocks, the follower copies its neighbour's first 3 keys and hashes the other 2, and ends with exactly the
    keys a fresh scheduler hashes for it alone. A prompt of another namespace shares nothing."""
    import pyarrow as pa

    from batchprefill.pipeline.order import shared_with_previous
    from batchprefill.pipeline.requests import link_prefix_donors

    neighbour_tokens = list(range(1, 81))
    follower_tokens = list(neighbour_tokens)
    follower_tokens[50] = 9_999
    shared = shared_with_previous(pa.chunked_array([[neighbour_tokens, follower_tokens, follower_tokens]]),
                                  pa.chunked_array([["", "", "tenant-b"]]), 16)
    assert shared.tolist() == [0, 3, 0]
    neighbour = Request(0, neighbour_tokens, SamplingParams())
    follower = Request(1, follower_tokens, SamplingParams())
    other = Request(2, list(follower_tokens), SamplingParams(), namespace="tenant-b")
    link_prefix_donors([neighbour, follower, other], shared)
    assert follower.prefix_donor is neighbour and other.prefix_donor is None
    together = make_scheduler()
    for request in (neighbour, follower, other):
        run_to_completion(together, request)
    alone = make_scheduler()
    fresh = Request(1, list(follower_tokens), SamplingParams())
    run_to_completion(alone, fresh)
    assert follower.block_hashes == fresh.block_hashes and len(fresh.block_hashes) == 5
    assert follower.block_hashes[:3] == neighbour.block_hashes[:3]
    assert follower.block_hashes[3] != neighbour.block_hashes[3]
    assert not set(other.block_hashes) & set(fresh.block_hashes)
