"""The scheduler's BatchRows columns stay in step with its running requests, and the decode pass on the columns
schedules exactly what the per-request loop schedules (hypothesis, no model)."""

import random

from hypothesis import given, settings

from batchprefill.engine.batch_rows import BatchRows
from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineSettings
from batchprefill.engine.request import Request, Status
from batchprefill.engine.scheduler import Scheduler
from batchprefill.sampling_params import SamplingParams
from tests.test_invariants import with_forks, workloads


def check_rows(scheduler: Scheduler) -> None:
    """Every running request's slot holds its computed tokens, block count and decoding state, in running order."""
    rows = scheduler.rows
    slots = rows.running_slots().tolist()
    assert slots == [rows.slot_of[id(r)] for r in scheduler.running]
    for request, slot in zip(scheduler.running, slots):
        assert request.status is Status.RUNNING
        assert rows.computed[slot] == request.num_computed_tokens
        assert rows.blocks[slot] == len(request.block_table)
        assert rows.decoding[slot] == request.is_decoding


def simulate(w: dict, one_by_one: bool) -> list[tuple]:
    """Run a random workload to the end as the engine would (commit, fork, append a token or finish), checking the
    columns before every step; returns each step's (request id, sample, tokens) chunks, preemptions and blocks."""
    rng = random.Random(w["seed"])
    size = w["block_size"]
    engine = EngineSettings(block_size=size, max_batched_tokens=w["budget"], max_num_seqs=w["max_seqs"],
                            prefix_caching=w["prefix_caching"], reserve_output_blocks=w["reserve_growth"])
    scheduler = Scheduler(BlockPool(w["num_blocks"]), engine, ("m",))
    if one_by_one:
        scheduler._decodes = scheduler._decodes_one_by_one
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 4 * size))] for _ in range(3)]
    next_id = [10_000]
    for i in range(w["num_requests"]):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * size))]
        request = Request(i, prompt, SamplingParams(max_tokens=0 if w["forks"] == "choices" else rng.randrange(1, 6)))
        request.forks = with_forks(request, w["forks"], rng, next_id)
        capacity = w["num_blocks"] * size
        if all(r.num_prompt_tokens + r.sampling.max_tokens <= capacity for r in (request, *request.forks)):
            scheduler.add(request)
    trace = []
    for _ in range(5000):
        if not scheduler.has_work():
            break
        check_rows(scheduler)
        step = scheduler.schedule()
        trace.append(([(r.request_id, r.sample_index, n) for r, n in zip(step.requests, step.num_tokens.tolist())],
                      scheduler.preemptions, [list(r.block_table) for r in step.requests]))
        scheduler.commit(step)
        for request in step.requests:
            if request.num_computed_tokens != request.num_tokens:
                continue
            children = list(request.forks)
            if children and not request.output_token_ids:
                scheduler.fork(request)
                for child in children:
                    if child.sampling.max_tokens:
                        child.output_token_ids.append(rng.randrange(50))
                        if len(child.output_token_ids) >= child.sampling.max_tokens:
                            scheduler.finish(child)
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                scheduler.finish(request)
                continue
            request.output_token_ids.append(rng.randrange(50))
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                scheduler.finish(request)
    assert not scheduler.has_work()
    return trace


@settings(max_examples=120, deadline=None)
@given(workloads)
def test_random_workloads_schedule_the_same_on_the_columns_as_one_by_one_and_the_columns_stay_in_step(w):
    assert simulate(w, one_by_one=False) == simulate(w, one_by_one=True)


def test_three_decodes_of_which_one_finishes_keep_their_slots_in_running_order_and_reuse_the_freed_one():
    rows = BatchRows(capacity=3)
    requests = [Request(i, [1, 2, 3], SamplingParams()) for i in range(3)]
    slots = [rows.add(r) for r in requests]
    assert slots == [0, 1, 2]
    rows.remove(requests[1])
    assert rows.running_slots().tolist() == [0, 2]
    late = Request(3, [1, 2, 3, 4], SamplingParams())
    late.num_computed_tokens, late.block_table = 3, [7]
    assert rows.add(late) == 1  # the freed slot, at the end of the running order
    assert rows.running_slots().tolist() == [0, 2, 1]
    assert (rows.computed[1], rows.blocks[1], rows.decoding[1]) == (3, 1, False)


def test_a_fourth_request_in_two_slots_doubles_them_to_four():
    rows = BatchRows(capacity=2)
    requests = [Request(i, [1], SamplingParams()) for i in range(4)]
    requests[3].output_token_ids, requests[3].num_computed_tokens = [5], 1  # decoding: 1 of 2 tokens computed
    assert [rows.add(r) for r in requests] == [0, 1, 2, 3]
    assert len(rows.computed) == 4 and rows.running_slots().tolist() == [0, 1, 2, 3]
    assert rows.decoding.tolist() == [False, False, False, True]
