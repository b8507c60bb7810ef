"""The overlapped loop (the host schedules and prepares step N+1 while the device runs step N, and reads step N's
tokens a step late) gives every request exactly the tokens and finish reason of the synchronous loop. It runs on
CUDA; here `EngineConfig.overlap` forces it on the CPU, on a tiny random Llama in batch-invariant mode (so the
extra step a finished request stays in cannot change anyone's floats)."""

import dataclasses
import gc
import random

import pytest
import torch

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request, with_samples
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton.ops import TritonOps
from batchprefill.sampling_params import SamplingParams
from tests.synthetic import tiny_llama

EOS = (0, 1, 2)  # three of the 50 tokens end a request: ends by EOS are common


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + token % 26) for token in ids)


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(TorchOps(batch_invariant=True), num_layers=2)
    model.config = dataclasses.replace(model.config, eos_token_ids=EOS, max_positions=64)  # ends by position too
    return model


def requests(count: int, seed: int, samples: bool = False,
             lengths: tuple[int, ...] = (1, 2, 7, 16, 50)) -> list[Request]:
    """Prompts of 3-60 tokens sharing some prefixes; max_tokens 1-50 (some past max_positions 64), greedy and
    drawn, some with stop strings; with `samples`, every fifth asks for 3 samples."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 50) for _ in range(24)] for _ in range(3)]
    made = []
    for index in range(count):
        own = [rng.randrange(3, 50) for _ in range(rng.randrange(3, 36))]
        prompt = rng.choice(shared)[: rng.randrange(0, 25)] + own
        params = SamplingParams(max_tokens=rng.choice(lengths), temperature=rng.choice([0.0, 0.0, 1.0]),
                                seed=seed, stop=("xy",) if index % 4 == 0 else (),
                                n=3 if samples and index % 5 == 0 else 1)
        request = Request(index, prompt, params)
        made.append(with_samples(request) if params.n > 1 else request)
    return made


def run(model, overlap: bool, rows: list[Request], num_blocks: int, **settings) -> tuple[dict, Engine]:
    config = EngineConfig(EngineSettings(block_size=8, **settings), num_blocks, overlap=overlap)
    engine = Engine(model, config, letters, ("tiny",), torch.float32, torch.device("cpu"))
    results = {(r.request_id, r.sample_index): (r.output_token_ids, r.finish_reason, r.output_text)
               for r in engine.generate(rows)}
    return results, engine


@pytest.mark.parametrize(("case", "settings"), [
    ("roomy pool", dict(num_blocks=400, max_num_seqs=16, max_batched_tokens=64)),
    ("a small pool that preempts", dict(num_blocks=40, max_num_seqs=12, max_batched_tokens=48,
                                        reserve_output_blocks=False)),
    ("n=3 samples", dict(num_blocks=400, max_num_seqs=16, max_batched_tokens=64, samples=True)),
])
def test_30_requests_get_the_same_tokens_and_finish_reasons_overlapped_as_synchronous(model, case, settings):
    samples = settings.pop("samples", False)
    synchronous, sync_engine = run(model, False, requests(30, 3, samples), **settings)
    overlapped, engine = run(model, True, requests(30, 3, samples), **settings)
    assert overlapped == synchronous
    assert engine.in_flight is None and not engine.has_work()
    assert all(token >= 0 for tokens, _, _ in overlapped.values() for token in tokens)  # no placeholder left
    reasons = [reason for _, reason, _ in synchronous.values()]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 3  # both ends are exercised
    assert engine.pool.num_available == sync_engine.pool.num_available  # every block given back
    waits = [s.token_wait_ms for s in engine.counters.steps]
    assert all(w >= 0 for w in waits) and any(w > 0 for w in waits)  # tokens landed a step later
    if case == "a small pool that preempts":
        assert sync_engine.scheduler.preemptions > 0 and engine.scheduler.preemptions > 0
    if case == "n=3 samples":
        assert len(overlapped) == 30 + 6 * 2


def test_a_request_ending_by_eos_a_step_late_drops_its_extra_token_and_frees_its_blocks(model):
    rows = requests(24, 11)
    synchronous, _ = run(model, False, rows, num_blocks=400, max_num_seqs=24, max_batched_tokens=512)
    overlapped, engine = run(model, True, requests(24, 11), num_blocks=400, max_num_seqs=24, max_batched_tokens=512)
    ended = [key for key, (tokens, reason, _) in synchronous.items() if reason == "stop" and tokens[-1] in EOS]
    assert ended and all(overlapped[key] == synchronous[key] for key in ended)
    assert engine.pool.num_available == 400 - sum(engine.pool.ref_counts[b] > 0 for b in range(400))
    assert len(engine.scheduler.running) == 0 and not engine.scheduler.waiting


def test_padded_decode_steps_gather_their_input_ids_from_the_last_steps_tokens_on_the_device():
    """The padded decode path (CUDA graphs on a GPU; here its eager twin on the Triton kernels) takes each decode's
    input id from the staged gather row, inside what a graph captures."""
    model = tiny_llama(TritonOps())
    model.config = dataclasses.replace(model.config, eos_token_ids=EOS, max_positions=64)
    results = []
    for overlap in (False, True):
        config = EngineConfig(EngineSettings(block_size=8, max_num_seqs=8, max_batched_tokens=256), 100,
                              padded_decode="eager", overlap=overlap)
        engine = Engine(model, config, letters, ("tiny",), torch.float32, torch.device("cpu"))
        assert engine.runner.decoder is not None
        results.append({r.request_id: (r.output_token_ids, r.finish_reason)
                        for r in engine.generate(requests(6, 5, lengths=(3, 6)))})
    assert results[1] == results[0]


def test_the_loop_runs_with_the_start_up_heap_frozen_out_of_the_garbage_collector_and_thaws_it_after(model):
    config = EngineConfig(EngineSettings(block_size=8, max_num_seqs=4, max_batched_tokens=64), 40, overlap=True)
    engine = Engine(model, config, letters, ("tiny",), torch.float32, torch.device("cpu"))
    before = gc.get_freeze_count()
    frozen = [gc.get_freeze_count() for _ in engine.generate(requests(3, 1, lengths=(2,)))]
    assert len(frozen) == 3 and min(frozen) > before and gc.get_freeze_count() == before
