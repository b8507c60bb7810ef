"""The Python API against the command line on the same job: what a notebook saves by keeping the model.

    python benchmarks/cpu/python_api.py [--calls 3] [--max-tokens 4]

On the shipped sample (data_samples/prompts.parquet, 51 rows), side by side in one process and its children:
- `cli`: `batchprefill-run` as a subprocess per job, as a notebook shells out to it (start-up, import, load, job).
- `run`: `batchprefill.run(path)` per job: no new process, but the model is loaded for every job.
- `runner`: `batchprefill.Runner(...)` once (its load timed apart), then `runner.run(path)` per job.
The three alternate, job by job, so that the load of a shared machine falls on each alike.
Each job gets the same config; every job's rows are checked to be the first job's (same tokens).
Also `stage`: writing 100,000 in-memory prompts (~300 characters) to Parquet, the cost the API adds for data that
is not a file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import batchprefill

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data_samples" / "prompts.parquet"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    config = {"sampling.max_tokens": args.max_tokens, "engine.kv_cache_tokens": 8192, "output.plot": False}
    cli_args = [f"{key}={value}" for key, value in config.items()] + ["output.progress=false"]
    times: dict[str, list[float]] = {"cli": [], "run": [], "runner": []}
    outputs = []
    started = time.perf_counter()
    runner = batchprefill.Runner(progress=False, **config)
    load = time.perf_counter() - started
    for _ in range(args.calls):  # interleaved, so that the machine's load falls on all three alike
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            subprocess.run([Path(sys.executable).parent / "batchprefill-run", f"data.input={SAMPLE}",
                            f"output.dir={out}", *cli_args], check=True, capture_output=True)
            times["cli"].append(time.perf_counter() - started)
            outputs.append(sorted(pq.read_table(Path(out) / "results")["output_token_ids"].to_pylist()))
        for name, job in (("run", lambda: batchprefill.run(SAMPLE, progress=False, **config)),
                          ("runner", lambda: runner.run(SAMPLE))):
            started = time.perf_counter()
            result = job()
            times[name].append(time.perf_counter() - started)
            outputs.append(sorted(result.table["output_token_ids"].to_list()))
    assert all(tokens == outputs[0] for tokens in outputs), "a job's tokens differ from the first job's"
    prompts = pa.table({"prompt": ["word " * 60] * 100_000})
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        pq.write_table(prompts, Path(folder) / "input.parquet")
        stage = time.perf_counter() - started
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    print(json.dumps({"calls": times, "median_s": median, "runner_load_s": load, "stage_100k_s": stage,
                      "cli_over_runner": median["cli"] / median["runner"],
                      "run_over_runner": median["run"] / median["runner"]}, indent=1))


if __name__ == "__main__":
    main()
