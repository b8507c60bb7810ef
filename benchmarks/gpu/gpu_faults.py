"""Issue 37's device checks: the torch backend runs a job on CUDA, and a model that runs three jobs keeps its
device memory flat (each job's KV pool and decode graphs go back when it ends).

    python benchmarks/gpu/gpu_faults.py --out faults.json             # one GPU, after gpu_job.py built its folder
    python benchmarks/gpu/gpu_faults.py --smoke --out /tmp/faults.json  # toy shapes on the CPU, to test the script

Both use gpu_job.py's random-weight folder and prompts (built here when missing). The memory check runs jobs the
way `batchprefill.Runner` does (the model loaded once, `run_job` per call; the Runner itself needs polars, which
the device lacks) and reads `torch.cuda.memory_allocated()` after each; the goal is the third within 1% of the
first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpu_job  # noqa: E402

from batchprefill.pipeline.build_engine import load_job_model  # noqa: E402
from batchprefill.pipeline.prepare import open_model  # noqa: E402
from batchprefill.pipeline.run import run_job  # noqa: E402
from batchprefill.settings import CONFIG_DIR, JobSettings  # noqa: E402


def job_settings(overrides: list[str]) -> JobSettings:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return JobSettings.from_config(compose("config", overrides=overrides))


def torch_backend_job(work: Path, shape: gpu_job.JobShape, device: str) -> dict:
    """The first rows through `engine.attention_backend=torch` and through the default backend: both must run; the
    share of rows with the same greedy tokens is reported (bf16 rounding may part them)."""
    rows = gpu_job.build_rows(shape)[:64]
    gpu_job.write_input(rows, work / "faults.parquet")
    short = gpu_job.JobShape(**{**shape.__dict__, "max_tokens": 8})
    outputs = {}
    for backend in ("torch", "auto"):
        out = work / f"faults_{backend}"
        run = gpu_job.run_job(work / "model", work / "faults.parquet", out, short,
                              [f"engine.attention_backend={backend}"], device)
        table = pq.read_table(out / "results").sort_by("id").to_pylist()
        outputs[backend] = [r["output_token_ids"] for r in table]
        print(f"  attention_backend={backend}: exit 0, {len(table)} rows, whole process "
              f"{run['whole_process_s']:.1f} s", flush=True)
    same = sum(a == b for a, b in zip(outputs["torch"], outputs["auto"], strict=True))
    return {"rows": len(rows), "torch_backend_ran": True, "same_greedy_tokens": same}


def memory_over_jobs(work: Path, device: str, jobs: int = 3) -> dict:
    """`torch.cuda.memory_allocated()` after each of `jobs` jobs on one loaded model."""
    base = [f"model.path={work / 'model'}", f"data.input={work / 'faults.parquet'}", f"engine.device={device}",
            "sampling.max_tokens=8", "sampling.ignore_eos=true", "output.plot=false", "output.progress=false"]
    model = load_job_model(job_settings([*base, f"output.dir={work}/mem0"]), open_model(job_settings(
        [*base, f"output.dir={work}/mem0"]).model))
    allocated, pools = [], []
    for index in range(jobs):
        shutil.rmtree(work / f"mem{index}", ignore_errors=True)  # a rerun runs every row again, not a resume
        job = job_settings([*base, f"output.dir={work}/mem{index}"])
        stats = run_job(job, model)
        allocated.append(torch.cuda.memory_allocated() if device == "cuda" else 0)
        pools.append(stats["free_blocks"])
        print(f"  job {index + 1}: {stats['num_requests']} requests, allocated after it "
              f"{allocated[-1] / 2**30:.2f} GiB", flush=True)
    first = allocated[0]
    drift = max(abs(a - first) for a in allocated) / first if first else 0.0
    return {"allocated_bytes": allocated, "pool_blocks": pools, "max_drift_vs_first": drift,
            "goal_met": drift <= 0.01}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/batchprefill-gpu-job"))
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    shape = gpu_job.SMOKE if args.smoke else gpu_job.LLAMA_1B
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / "model" / "config.json").exists():
        from batchprefill.model.loader import resolve_folder

        gpu_job.build_folder(shape, args.work / "model", args.tokenizer or resolve_folder(None), torch.device(device))
    results: dict = {}
    print("torch backend on the device:", flush=True)
    results["torch_backend"] = torch_backend_job(args.work, shape, device)
    args.out.write_text(json.dumps(results, indent=2))
    print("device memory over three jobs on one model:", flush=True)
    results["memory"] = memory_over_jobs(args.work, device)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
