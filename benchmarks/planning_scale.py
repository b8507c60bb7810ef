"""Planning at scale: read, tokenize, partition, order and shard-plan N synthetic prompts, without the model.

    python benchmarks/planning_scale.py                    # 100k, 300k and 1M rows (about 40 minutes on 2 cores)
    python benchmarks/planning_scale.py --rows 100000      # one quick point

For each row count it runs two fresh subprocesses on the same Parquet file, so that each peak RSS is its own:
`tokenize` streams the prompt column in record batches through `encode_batch` and discards the ids (the
floor: no planning can be faster), and `plan` does what `batchprefill-plan` and the start of
`batchprefill-run` do: `prepare_job` (read, tokenize, error rows, spill into partitions), shard assignment
for `--shards` shards, then every partition read back and put in prefix order with its groups and reusable
tokens. The ratio plan / tokenize is the cost of ordering and sharding around tokenization.

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
READ_BATCH_ROWS = 8192


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


def tokenize_only(path: Path) -> dict:
    """The floor: stream the prompts with batchprefill's reader, tokenize them in batches, keep nothing."""
    from batchprefill.dataset import open_dataset, record_batches

    tokenizer = _tokenizer()
    tokens = 0
    for batch in record_batches(open_dataset([path], "parquet"), READ_BATCH_ROWS, ["prompt"]):
        tokens += sum(map(len, tokenizer.encode_batch(batch.column(0).to_pylist())))
    return {"tokens": tokens}


def plan(path: Path, out: Path, shards: int, buffer_mb: int) -> dict:
    """`prepare_job`, the shard plan, and every partition in prefix order: the job up to the engine."""
    import pyarrow.compute as pc
    from hydra import compose, initialize_config_dir

    from batchprefill.cli import CONFIG_DIR
    from batchprefill.order import assign_shards, groups, prefix_order, reusable_tokens
    from batchprefill.preparation import prepare_job
    from batchprefill.prepare import ERROR, NAMESPACE, TOKENS, partition_path
    from batchprefill.settings import JobSettings

    overrides = [f"data.input={path}", f"output.dir={out}", f"data.num_shards={shards}", "data.shard_index=0",
                 f"data.buffer_mb={buffer_mb}", "output.progress=false"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = JobSettings.from_config(cfg)
    prepared = prepare_job(job)
    prepared_at = time.perf_counter()
    manifest = prepared.manifest
    assignment = assign_shards(manifest.partition_tokens, shards)
    block_size = job.engine.block_size
    num_groups = reused = largest = 0
    for part in range(manifest.num_partitions):
        table = pq.read_table(partition_path(prepared.partitions_dir, part))
        table = table.filter(pc.is_null(table[ERROR]))
        largest = max(largest, table.nbytes)
        ordered = table.take(prefix_order(table[TOKENS], table[NAMESPACE]))
        num_groups += len(groups(ordered[TOKENS], ordered[NAMESPACE], block_size))
        reused += sum(reusable_tokens(ordered[TOKENS], ordered[NAMESPACE], block_size))
    loads = [sum(manifest.partition_tokens[p] for p in shard) for shard in assignment]
    return {"order_s": time.perf_counter() - prepared_at,
            "partitions": manifest.num_partitions, "largest_partition_mb": largest / 2**20,
            "tokens": sum(manifest.partition_tokens), "groups": num_groups, "reusable_tokens": reused,
            "shard_imbalance": max(loads) / (sum(loads) / shards) - 1}


def measure(args: list[str], script: str = __file__) -> tuple[float, float, float, dict]:
    """Wall seconds, CPU seconds, peak RSS in MB and the result of one worker subprocess of `script` (os.wait4:
    this child alone). CPU seconds say more than wall seconds on a machine other work shares."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"worker {args[:2]} failed with {child.returncode}")
    cpu = usage.ru_utime + usage.ru_stime
    return wall, cpu, usage.ru_maxrss / 1024, json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--buffer-mb", type=int, default=1024, help="data.buffer_mb of the plan runs")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bp-planning"))
    parser.add_argument("--worker", choices=["tokenize", "plan"], help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "tokenize":
        print(json.dumps(tokenize_only(args.input)))
        return
    if args.worker == "plan":
        print(json.dumps(plan(args.input, args.dir, args.shards, args.buffer_mb)))
        return
    print(f"{os.cpu_count()} CPUs, {args.shards} shards, data.buffer_mb={args.buffer_mb}")
    print("| rows | tokens | tokenize wall s | tokenize CPU s | tokenize peak MB | plan wall s | plan CPU s "
          "| plan peak MB | plan/tokenize wall | plan/tokenize CPU | order s | partitions | largest partition MB "
          "| shard imbalance |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        data = generate(args.dir / f"prompts-{rows}.parquet", rows)
        token_wall, token_cpu, token_mb, _ = measure(["--worker", "tokenize", "--input", str(data)])
        out = args.dir / f"out-{rows}"
        shutil.rmtree(out, ignore_errors=True)
        plan_wall, plan_cpu, plan_mb, result = measure(["--worker", "plan", "--input", str(data), "--dir", str(out),
                                              "--shards", str(args.shards), "--buffer-mb", str(args.buffer_mb)])
        shutil.rmtree(out, ignore_errors=True)
        print(f"| {rows:,} | {result['tokens']:,} | {token_wall:.0f} | {token_cpu:.0f} | {token_mb:.0f} "
              f"| {plan_wall:.0f} | {plan_cpu:.0f} | {plan_mb:.0f} | {plan_wall / token_wall:.2f} "
              f"| {plan_cpu / token_cpu:.2f} | {result['order_s']:.1f} | {result['partitions']} "
              f"| {result['largest_partition_mb']:.0f} | {result['shard_imbalance']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
