"""Planning at scale: `batchprefill-plan`, and `batchprefill-run` up to its first step, against tokenizing alone.

    python benchmarks/cpu/planning_scale.py                    # 200k and 1M rows
    python benchmarks/cpu/planning_scale.py --rows 200000      # one point

For each row count it runs fresh subprocesses on the same Parquet file, each timed as a whole process (wall
seconds, CPU seconds and peak RSS of that child alone, from os.wait4):
- `tokenize`, the floor: the prompt column read with pyarrow in 4,096-row batches and put through the
  `tokenizers` library's `encode_batch`, keeping nothing. No preparation can be faster.
- `plan`: `python -m batchprefill.plan` on the file: read, tokenize, error rows, spill into partitions, then
  every partition of every shard ordered and tallied, the report and the figure.
- `load`: loading the model as `batchprefill-run` does (torch imported, weights read and prepacked).
- `first step`: `python -m batchprefill.run` on the file, stopped as its engine enters its first step, so it
  counts start-up, preparation (into a fresh output folder), model loading and the engine's set-up, with
  its KV pool fixed by --kv-cache-tokens so that the set-up does not follow the machine's free memory.
Goals (issue 16): plan wall <= 1.3 x tokenize wall; first step wall <= 1.3 x (tokenize + load) wall.

The dataset is deterministic (seeded) and written in chunks, so generating it is bounded in memory too:
a few hundred system prompts, each with its own documents, each followed by one of many questions, drawn
from words that are one token each, so lengths are exact: 50 to 500 tokens, about 275 on average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SYSTEMS, DOCS_PER_SYSTEM, QUESTIONS = 300, 40, 5000
SYSTEM_WORDS, DOC_WORDS, QUESTION_WORDS = (30, 90), (50, 330), (5, 45)  # mean 60 + 190 + 25 = 275 tokens
CHUNK_ROWS = 65_536
TOKENIZE_BATCH_ROWS = 4096  # the floor's batches, as the issue measured it


def _tokenizer():
    from batchprefill.model.loader import resolve_folder
    from batchprefill.model.tokenizer import PromptTokenizer

    return PromptTokenizer(resolve_folder(None))


def _words() -> np.ndarray:
    """Lower-case words that the shipped tokenizer keeps as one token after a space: lengths come out exact."""
    vocab = _tokenizer().tokenizer.get_vocab()
    return np.array(sorted(w[1:] for w in vocab if w.startswith("Ġ") and re.fullmatch(r"[a-z]{3,12}", w[1:])))


def _texts(rng: np.random.Generator, words: np.ndarray, count: int, bounds: tuple[int, int]) -> list[str]:
    return [" ".join(rng.choice(words, rng.integers(*bounds, endpoint=True))) for _ in range(count)]


def generate(path: Path, rows: int, seed: int = 0) -> Path:
    """The dataset of `rows` prompts, made once per (rows, seed) and written a chunk at a time."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    words = _words()
    systems = _texts(rng, words, SYSTEMS, SYSTEM_WORDS)
    docs = _texts(rng, words, SYSTEMS * DOCS_PER_SYSTEM, DOC_WORDS)
    questions = _texts(rng, words, QUESTIONS, QUESTION_WORDS)
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
    staging = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(staging, schema) as writer:
        for start in range(0, rows, CHUNK_ROWS):
            count = min(CHUNK_ROWS, rows - start)
            system = rng.integers(0, SYSTEMS, count)
            doc = system * DOCS_PER_SYSTEM + rng.integers(0, DOCS_PER_SYSTEM, count)
            question = rng.integers(0, QUESTIONS, count)
            prompts = [f"{systems[s]} {docs[d]} {questions[q]}" for s, d, q in zip(system, doc, question)]
            ids = np.arange(start, start + count, dtype=np.int64)
            writer.write_table(pa.table({"id": ids, "prompt": prompts}, schema=schema))
    staging.rename(path)
    return path


def tokenize_only(path: Path, folder: Path) -> dict:
    """The floor: the prompt column in 4,096-row batches through `encode_batch`; only pyarrow and tokenizers."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=TOKENIZE_BATCH_ROWS, columns=["prompt"]):
        encodings = tokenizer.encode_batch(batch.column(0).to_pylist(), add_special_tokens=False)
        tokens += sum(len(encoding.ids) for encoding in encodings)
    return {"tokens": tokens}


def load_only(folder: Path) -> dict:
    """Model loading as `run_job` does it, on the device and in the dtype a run would pick."""
    from batchprefill.model.loader import load_model, make_ops, resolve_device, resolve_dtype

    device = resolve_device("auto")
    load_model(folder, resolve_dtype("auto", device), device, make_ops("auto", device))
    return {}


def until_first_step(overrides: list[str]) -> None:
    """`batchprefill-run` as a user starts it, ended the moment its engine enters its first step."""
    from batchprefill.cli.run import main as run
    from batchprefill.engine.engine import Engine

    def stop(engine: Engine) -> None:
        print(json.dumps({}), flush=True)
        os._exit(0)

    Engine.step = stop
    sys.argv = ["batchprefill-run", *overrides]
    run()
    raise SystemExit("the run ended without a step")


def measure(args: list[str]) -> tuple[float, float, float, dict]:
    """Wall seconds, CPU seconds, peak RSS in MB and the last stdout line's JSON (if any) of one subprocess
    (os.wait4: this child alone). CPU seconds say more than wall seconds on a machine other work shares."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{args[:3]} failed with {child.returncode}")
    cpu = usage.ru_utime + usage.ru_stime
    lines = output.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return wall, cpu, usage.ru_maxrss / 1024, result


def _partitions(out: Path, shards: int) -> dict:
    """The partitions the plan wrote: how many, the largest, and how evenly whole partitions fill the shards."""
    from batchprefill.pipeline.order import assign_shards

    manifest = json.loads((out / "partitions" / "manifest.json").read_text())
    loads = [sum(manifest["partition_tokens"][p] for p in shard)
             for shard in assign_shards(manifest["partition_tokens"], shards)]
    return {"partitions": len(manifest["partition_rows"]), "largest_mb": max(manifest["partition_bytes"]) / 2**20,
            "tokens": sum(manifest["partition_tokens"]), "imbalance": max(loads) / (sum(loads) / shards) - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--shards", type=int, default=8, help="data.num_shards: at least 4 partitions per shard")
    parser.add_argument("--buffer-mb", type=int, default=1024, help="data.buffer_mb of the plan and the run")
    parser.add_argument("--kv-cache-tokens", type=int, default=65_536, help="engine.kv_cache_tokens of the run")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bp-planning"))
    parser.add_argument("--worker", choices=["tokenize", "load", "first-step"], help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.worker == "tokenize":
        print(json.dumps(tokenize_only(args.input, args.model)))
        return
    if args.worker == "load":
        print(json.dumps(load_only(args.model)))
        return
    if args.worker == "first-step":
        until_first_step(overrides)
        return
    from batchprefill.model.loader import resolve_folder

    model = resolve_folder(None)  # converted once, here, so no child pays for it
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.shards} shards, "
          f"data.buffer_mb={args.buffer_mb}")
    print("| rows | tokens | tokenize wall s | tokenize CPU s | plan wall s | plan CPU s | plan peak MB "
          "| plan/tokenize wall | plan/tokenize CPU | load wall s | first step wall s | first step peak MB "
          "| first step/(tokenize+load) wall | partitions | largest partition MB | shard imbalance |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        data = generate(args.dir / f"prompts-{rows}.parquet", rows)
        job = [f"data.input={data}", f"data.num_shards={args.shards}", "data.shard_index=0",
               f"data.buffer_mb={args.buffer_mb}", "output.progress=false"]
        token_wall, token_cpu, _, floor = measure([__file__, "--worker", "tokenize", "--input", str(data),
                                                   "--model", str(model)])
        out = args.dir / f"out-{rows}"
        shutil.rmtree(out, ignore_errors=True)
        plan_wall, plan_cpu, plan_mb, _ = measure(["-m", "batchprefill.plan", *job, f"output.dir={out}"])
        parts = _partitions(out, args.shards)
        if parts["tokens"] != floor["tokens"]:
            raise SystemExit(f"the plan counted {parts['tokens']} tokens, the floor {floor['tokens']}")
        shutil.rmtree(out)
        load_wall, _, _, _ = measure([__file__, "--worker", "load", "--model", str(model)])
        step_wall, _, step_mb, _ = measure([__file__, "--worker", "first-step", *job, f"output.dir={out}",
                                            f"engine.kv_cache_tokens={args.kv_cache_tokens}"])
        shutil.rmtree(out)
        print(f"| {rows:,} | {floor['tokens']:,} | {token_wall:.1f} | {token_cpu:.1f} | {plan_wall:.1f} "
              f"| {plan_cpu:.1f} | {plan_mb:.0f} | {plan_wall / token_wall:.2f} | {plan_cpu / token_cpu:.2f} "
              f"| {load_wall:.1f} | {step_wall:.1f} | {step_mb:.0f} | {step_wall / (token_wall + load_wall):.2f} "
              f"| {parts['partitions']} | {parts['largest_mb']:.0f} | {parts['imbalance']:.1%} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
