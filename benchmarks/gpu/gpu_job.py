"""A shared-prefix job through the command line on one GPU, against its floor and HF transformers' generate.

    python benchmarks/gpu/gpu_job.py --tokenizer DIR --out results.json     # one H200: about 2 minutes
    python benchmarks/gpu/gpu_job.py --smoke --out /tmp/job.json             # toy shapes on the CPU, to test the script

The job is issue 38's: a random-weight folder of Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 query and 8 KV
heads of 64, intermediate 8192, tied embeddings) with SmolLM2's 49,152-token vocabulary (the shipped tokenizer's
files from `--tokenizer`, so outputs detokenize), bfloat16; 4,096 rows as token ids: 16 system prompts of 704
tokens, 256 questions of 16-48 tokens under each, shuffled, 64 output tokens each with `sampling.ignore_eos=true`.
It runs as a user runs it (`python -m batchprefill.run`, default engine settings unless `--set` adds overrides),
twice: the first run on a fresh machine compiles the Triton kernels into their disk cache, the second is the
figure. Printed and written: the whole process, the engine loop (the sum of stats/steps.parquet's step
durations), where the whole process's time went (process_clock.py: interpreter, imports, Hydra, the job's own
prepare/load/warm-up/engine loop/rest, the exit), the decode-only steps' breakdown at their largest batch, and the
floors beside them:
- job floor: prefill FLOPs (2 x parameters x computed prompt tokens, plus attention pairs) over the measured bf16
  matmul rate, plus decode steps (output tokens / max_num_seqs) x the weights' bytes over the copy bandwidth;
- decode step floor at its batch: weights + each sequence's own KV + each group's shared prefix once, over the
  measured copy bandwidth.
The peer is HF transformers' `generate` (bfloat16, left padding, batch 128, the same 64 tokens) on the first
`--peer-rows` rows, beside our command line on the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class JobShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    prefixes: int
    questions: int
    prefix_tokens: int
    question_tokens: tuple[int, int]
    max_tokens: int


LLAMA_1B = JobShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=49152, prefixes=16, questions=256,
                    prefix_tokens=704, question_tokens=(16, 48), max_tokens=64)
SMOKE = JobShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49152, prefixes=2, questions=6,
                 prefix_tokens=48, question_tokens=(3, 9), max_tokens=4)


def build_folder(shape: JobShape, folder: Path, tokenizer: Path | None, device: torch.device) -> int:
    """A random-weight Llama folder of `shape` in bfloat16, with the tokenizer's files; returns its parameters."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer is not None and (tokenizer / name).exists():
            (folder / name).write_bytes((tokenizer / name).read_bytes())
    parameters = sum(p.numel() for p in model.parameters())
    del model
    return parameters


def build_rows(shape: JobShape) -> list[list[int]]:
    """The prompts as token ids, shuffled (the job orders them by prefix itself)."""
    rng = random.Random(0)
    systems = [[rng.randrange(3, shape.vocab) for _ in range(shape.prefix_tokens)] for _ in range(shape.prefixes)]
    rows = [system + [rng.randrange(3, shape.vocab) for _ in range(rng.randint(*shape.question_tokens))]
            for system in systems for _ in range(shape.questions)]
    rng.shuffle(rows)
    return rows


def write_input(rows: list[list[int]], path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(len(rows))), "prompt": pa.array(rows, pa.list_(pa.int32()))}), path)


def run_job(folder: Path, data: Path, out: Path, shape: JobShape, overrides: list[str], device: str) -> dict:
    """One `python -m batchprefill.run` as a user starts it (through process_clock.py, which times the process
    around the job): whole-process seconds, where they went, and what stats/ says."""
    times = out.with_name(out.name + "-process.json")
    args = [sys.executable, str(Path(__file__).with_name("process_clock.py")), str(times), f"data.input={data}",
            f"output.dir={out}", f"model.path={folder}", f"sampling.max_tokens={shape.max_tokens}",
            "sampling.ignore_eos=true", "output.plot=false", "output.progress=false", "output.resume=false",
            f"engine.device={device}", *overrides]
    shutil.rmtree(out, ignore_errors=True)  # this script's own folder: a rerun starts the job afresh
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    spawned, began = time.time(), time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    whole, reaped = time.perf_counter() - began, time.time()
    if done.returncode != 0:
        raise RuntimeError(f"the job exited {done.returncode}: {done.stderr[-3000:]}")
    job = pq.read_table(out / "stats" / "job.parquet").to_pylist()[0]
    steps = pq.read_table(out / "stats" / "steps.parquet").to_pandas()
    process = process_phases(json.loads(times.read_text()) | {"spawned": spawned, "reaped": reaped}, job,
                             steps.duration_ms.sum() / 1e3)
    return {"whole_process_s": whole, "job": job, "steps": steps, "process": process,
            "summary": done.stderr.strip().splitlines()[-6:]}


PROCESS_PHASES = [("interpreter_s", "spawned", "script"), ("import_torch_s", "script", "torch_imported"),
                  ("import_cli_s", "torch_imported", "cli_imported"),
                  ("import_pipeline_s", "cli_imported", "pipeline_imported"),
                  ("hydra_and_config_s", "pipeline_imported", "job_entered"), ("job_s", "job_entered", "job_returned"),
                  ("after_job_s", "job_returned", "atexit"), ("exit_teardown_s", "atexit", "reaped")]


def process_phases(marks: dict, job: dict, engine_loop_s: float) -> dict:
    """Seconds between process_clock.py's instants, and the job's own split of its time (stats/job.parquet):
    preparing the input, loading, warming up, the engine loop, and the rest (the bar's feeding of requests outside
    steps, writing results and statistics)."""
    phases = {name: round(marks[end] - marks[start], 3) for name, start, end in PROCESS_PHASES}
    inside = {name: round(job.get(column, float("nan")), 3) for name, column in
              (("prepare_s", "prepare_seconds"), ("load_s", "load_seconds"), ("warm_up_s", "warm_up_seconds"))}
    inside["engine_loop_s"] = round(engine_loop_s, 3)
    inside["rest_s"] = round(job["wall_seconds"] - sum(inside.values()), 3)
    return phases | {"inside_job": inside}


def step_breakdown(steps, timing_columns: list[str]) -> dict:
    """The decode-only steps at the largest batch they reached: medians of each timing column."""
    decode = steps[(steps.num_prefill_tokens == 0) & (steps.num_decode_tokens > 0)]
    if decode.empty:
        return {}
    top = decode[decode.num_decode_tokens >= 0.9 * decode.num_decode_tokens.max()]
    return {"decode_steps": len(decode), "at_batch": int(top.num_decode_tokens.median()), "steps_counted": len(top),
            **{f"median_{c}": float(top[c].median()) for c in timing_columns if c in top}}


def floors(shape: JobShape, parameters: int, job: dict, rows: list[list[int]], batch: int, ceilings: dict) -> dict:
    """Seconds no engine can beat on this device for the job, and milliseconds for a decode step at `batch`."""
    head_dim = shape.hidden // shape.heads
    kv_per_token = 2 * shape.layers * shape.kv_heads * head_dim * 2
    computed = job["computed_prompt_tokens"]
    fresh = [len(r) - shape.prefix_tokens for r in rows]
    pairs = sum(u * shape.prefix_tokens + u * (u + 1) // 2 for u in fresh)
    pairs += shape.prefixes * shape.prefix_tokens * (shape.prefix_tokens + 1) // 2
    prefill_flops = 2 * parameters * computed + 4 * shape.layers * shape.heads * head_dim * pairs
    weight_bytes = 2 * parameters
    copy = ceilings["copy_gbps"] * 1e9
    max_seqs = max(1, int(job.get("max_num_seqs") or batch))
    decode_steps = -(-len(rows) // max_seqs) * shape.max_tokens
    job_floor = prefill_flops / (ceilings["matmul_tflops"] * 1e12) + decode_steps * weight_bytes / copy
    own_tokens = float(np.mean(fresh)) + shape.max_tokens / 2
    groups = min(shape.prefixes, batch)
    step_bytes = weight_bytes + batch * own_tokens * kv_per_token + groups * shape.prefix_tokens * kv_per_token
    return {"job_floor_s": job_floor, "prefill_flops": prefill_flops, "decode_step_floor_ms": step_bytes / copy * 1e3,
            "decode_step_bytes": step_bytes, "kv_bytes_per_token": kv_per_token}


def measure_ceilings(device: torch.device) -> dict:
    """Copy GB/s (bytes read + written) and bf16 matmul TFLOP/s, measured by benchmarks/gpu/gpu.py's own code."""
    if device.type != "cuda":
        return {"copy_gbps": 10.0, "matmul_tflops": 1.0}  # the smoke run's stand-ins
    import gpu  # beside this file; it pulls in triton, which only a GPU run needs

    return gpu.measure_ceilings(gpu.Plan(), device, gpu.Timer(device))


def hf_generate(folder: Path, rows: list[list[int]], shape: JobShape, device: torch.device, batch: int) -> float:
    """Seconds for transformers' generate over `rows`: greedy, bfloat16, left-padded batches, every row
    `max_tokens` new tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    seconds = 0.0
    for warm in (True, False):
        chosen = rows[:batch] if warm else rows
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for start in range(0, len(chosen), batch):
            part = chosen[start : start + batch]
            width = max(map(len, part))
            ids = torch.tensor([[0] * (width - len(r)) + r for r in part], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in part], device=device)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=shape.max_tokens,
                               min_new_tokens=shape.max_tokens, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
    del model
    return seconds


TIMINGS = ["duration_ms", "schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "bookkeeping_ms"]


def summarize(run: dict) -> dict:
    steps = run["steps"]
    durations = steps.duration_ms.to_numpy()
    return {"whole_process_s": round(run["whole_process_s"], 2), "engine_loop_s": round(durations.sum() / 1e3, 3),
            "engine_loop_after_first_3_steps_s": round(durations[3:].sum() / 1e3, 3), "steps": len(steps),
            "first_3_steps_ms": [round(float(d), 1) for d in durations[:3]],
            "computed_prompt_tokens": run["job"]["computed_prompt_tokens"],
            "ideal_cached_tokens": run["job"]["ideal_cached_tokens"], "cached_tokens": run["job"]["cached_tokens"],
            "output_tokens": run["job"]["output_tokens"], "max_batched_tokens": run["job"]["max_batched_tokens"],
            "decode": step_breakdown(steps, TIMINGS), "process": run["process"], "summary": run["summary"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_job.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/batchprefill-gpu-job"))
    parser.add_argument("--tokenizer", type=Path, help="a folder with the shipped tokenizer's files")
    parser.add_argument("--set", action="append", default=[], help="an engine override for our runs, key=value")
    parser.add_argument("--runs", type=int, default=2, help="runs of the whole job (the first compiles)")
    parser.add_argument("--peer-rows", type=int, default=256, help="rows for HF generate and ours beside it (0: none)")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on the CPU, to test this script")
    args = parser.parse_args()
    shape = SMOKE if args.smoke else LLAMA_1B
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        sys.exit("no GPU: run with --smoke to test the script on the CPU")
    if args.tokenizer is None:
        from batchprefill.model.loader import resolve_folder

        args.tokenizer = resolve_folder(None)
    args.work.mkdir(parents=True, exist_ok=True)
    folder, data = args.work / "model", args.work / "prompts.parquet"
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "overrides": args.set}
    began = time.perf_counter()
    parameters = build_folder(shape, folder, args.tokenizer, device)
    rows = build_rows(shape)
    write_input(rows, data)
    results |= {"parameters": parameters, "rows": len(rows), "prompt_tokens": sum(map(len, rows)),
                "build_s": round(time.perf_counter() - began, 1)}
    results["ceilings"] = measure_ceilings(device)
    print(f"{results['device']}: {parameters / 1e9:.2f}B parameters, {len(rows)} rows, ceilings "
          f"{results['ceilings']['copy_gbps']:.0f} GB/s copy, {results['ceilings']['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    engine_device = "cuda" if device.type == "cuda" else "cpu"
    results["runs"] = []
    for index in range(args.runs):
        run = run_job(folder, data, args.work / f"out{index}", shape, args.set, engine_device)
        results["runs"].append(summarize(run))
        last = results["runs"][-1]
        print(f"run {index + 1}: whole process {last['whole_process_s']:.1f} s, engine loop "
              f"{last['engine_loop_s']:.2f} s ({last['steps']} steps; first three {last['first_3_steps_ms']} ms), "
              f"decode steps {json.dumps(last['decode'])}; the process {json.dumps(last['process'])}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str))
    best = min(results["runs"], key=lambda r: r["engine_loop_s"])
    job = {"computed_prompt_tokens": best["computed_prompt_tokens"], "max_num_seqs": best["decode"].get("at_batch")}
    results["floors"] = floors(shape, parameters, job, rows, best["decode"].get("at_batch", 1), results["ceilings"])
    fl = results["floors"]
    print(f"floors: job {fl['job_floor_s']:.3f} s (engine loop {best['engine_loop_s'] / fl['job_floor_s']:.1f}x it); "
          f"decode step at {best['decode'].get('at_batch')} sequences {fl['decode_step_floor_ms']:.3f} ms "
          f"(median step {best['decode'].get('median_duration_ms', float('nan')):.3f} ms)", flush=True)
    if args.peer_rows:
        peer = rows[: args.peer_rows]
        write_input(peer, args.work / "peer.parquet")
        ours = summarize(run_job(folder, args.work / "peer.parquet", args.work / "peer_out", shape, args.set,
                                 engine_device))
        hf = hf_generate(folder, peer, shape, device, batch=128 if device.type == "cuda" else 4)
        results["peer"] = {"rows": len(peer), "hf_generate_s": round(hf, 3),
                           "ours_engine_loop_s": ours["engine_loop_s"], "ours_whole_process_s": ours["whole_process_s"]}
        print(f"peer on {len(peer)} rows: HF generate {hf:.2f} s, ours engine loop {ours['engine_loop_s']:.2f} s "
              f"(whole process {ours['whole_process_s']:.1f} s)", flush=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
