"""One admission wave on the scheduler alone (no engine, no model): the host work issue 38 left per request.

    python benchmarks/cpu/admission.py                  # this checkout
    python benchmarks/cpu/admission.py --baseline REV   # and the code at git REV, runs interleaved

As in host_overhead.py's workload, 300 prompts share a 1,500-token document and differ in a 20-token question
(1,520 tokens, 95 blocks of 16), each linked to its neighbour as the order stage links them. The first schedule
admits one request and holds the others back while it fills the shared blocks (they are matched, and wait); once
its blocks are committed, the next schedule admits as many as its 8,192-token budget takes (256: each reuses 93
cached blocks), they commit, and they finish. Each phase's time is the minimum over `--reps` waves, so a busy
shared machine adds less noise than host_overhead.py's dozen admitting steps a run; the baseline runs alternate
with this checkout's, each in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

PHASES = ("held_back_ms", "admit_ms", "commit_ms", "finish_ms")


def wave(prompts: list[list[int]]) -> tuple[int, list[float]]:
    """The admitted count and each phase's milliseconds, on a fresh scheduler."""
    from batchprefill.engine.block_pool import BlockPool
    from batchprefill.engine.config import EngineSettings
    from batchprefill.engine.request import Request
    from batchprefill.engine.scheduler import Scheduler
    from batchprefill.sampling_params import SamplingParams

    settings = EngineSettings(block_size=16, max_batched_tokens=8192, max_num_seqs=1024)
    scheduler = Scheduler(BlockPool(40_000), settings, ("tiny",))
    requests = [Request(i, p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)]
    for previous, request in zip(requests, requests[1:]):
        request.prefix_donor, request.donor_blocks = previous, 1500 // 16
    for request in requests:
        scheduler.add(request)
    clock = [time.perf_counter()]
    step = scheduler.schedule()  # the first fills the document's blocks; the others are matched and held back
    clock.append(time.perf_counter())
    scheduler.commit(step)
    requests[0].output_token_ids.append(7)  # its first token: it decodes from now on
    start = time.perf_counter()
    step = scheduler.schedule()
    clock += [start, time.perf_counter()]
    scheduler.commit(step)
    clock.append(time.perf_counter())
    for request in step.requests[1:]:
        scheduler.finish(request)
    clock.append(time.perf_counter())
    spans = [clock[1] - clock[0], clock[3] - clock[2], clock[4] - clock[3], clock[5] - clock[4]]
    return len(step.requests) - 1, [1e3 * span for span in spans]


def measure(reps: int) -> dict:
    rng = random.Random(0)
    document = [rng.randrange(3, 49152) for _ in range(1500)]
    prompts = [document + [rng.randrange(3, 49152) for _ in range(20)] for _ in range(300)]
    waves = [wave(prompts) for _ in range(reps)]
    result = {"admitted": waves[0][0]}
    for index, phase in enumerate(PHASES):
        result[phase] = round(min(w[1][index] for w in waves), 3)
    return result


def child(tree: Path, reps: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--json", "--reps", str(reps)],
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision to measure, interleaved with this checkout")
    parser.add_argument("--reps", type=int, default=15, help="waves a run (the minimum is reported)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--json", action="store_true", help="one run of this checkout's figures as one JSON line")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.reps)))
        return
    trees = {"this": Path(__file__).resolve().parents[2]}
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    from revisions import checkout

    with checkout(args.baseline) if args.baseline else nullcontext() as baseline:
        if baseline is not None:
            trees["baseline"] = baseline
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(child(tree, args.reps))
    for name, results in runs.items():
        if results:
            phases = ", ".join(f"{p[:-3]} {min(r[p] for r in results):.3f}" for p in PHASES)
            print(f"{name:>10}: {results[0]['admitted']} admitted; ms (min over {args.rounds} x {args.reps}): {phases}")
    if args.baseline:
        print(f"{'ratio':>10}: " + ", ".join(
            f"{p[:-3]} {min(r[p] for r in runs['this']) / min(r[p] for r in runs['baseline']):.2f}" for p in PHASES))


if __name__ == "__main__":
    main()
