"""What checking the ids costs: the id pass of `prepare` against the passes it sits beside, and its memory.

    python benchmarks/cpu/id_check.py                              # 100k prompts; 10M and 50M string ids
    python benchmarks/cpu/id_check.py --rows 100000 --id-rows 10000000

Part 1, on `planning_scale.py`'s 100k-prompt dataset (int64 ids, ~276 tokens a prompt), each in a fresh
subprocess: `ids` reads the id column alone and runs `check_unique_ids` (what prepare adds), `decode` streams
every column without tokenizing (prepare's existing sizing pass), `tokenize` is the tokenizer floor.
Part 2, on files holding only string ids ("id-000000000042", 15 bytes), the id pass alone at 10M and 50M rows:
its peak RSS should stay flat as the ids outgrow one 64 MB bucket and spill to disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planning_scale import READ_BATCH_ROWS, generate, measure, tokenize_only  # noqa: E402

ID_CHUNK_ROWS = 1 << 22


def id_pass(path: Path) -> dict:
    from batchprefill.io.formats import open_dataset
    from batchprefill.io.input_format import record_batches
    from batchprefill.io.unique_ids import check_unique_ids
    from batchprefill.pipeline.partitions import ID_READ_ROWS

    dataset = open_dataset([path], "parquet")
    rows = dataset.count_rows()
    with tempfile.TemporaryDirectory() as folder:
        check_unique_ids((b.column(0) for b in record_batches(dataset, ID_READ_ROWS, ["id"])), "id",
                         Path(folder) / "ids", rows)
    return {"rows": rows}


def decode_pass(path: Path) -> dict:
    from batchprefill.io.formats import open_dataset
    from batchprefill.io.input_format import record_batches

    return {"bytes": sum(b.nbytes for b in record_batches(open_dataset([path], "parquet"), READ_BATCH_ROWS))}


def string_ids(path: Path, rows: int) -> Path:
    """A Parquet file of `rows` distinct 15-byte string ids, written in chunks."""
    if not path.exists():
        with pq.ParquetWriter(path, pa.schema([("id", pa.string())])) as writer:
            for start in range(0, rows, ID_CHUNK_ROWS):
                numbers = pc.cast(pa.array(range(start, min(start + ID_CHUNK_ROWS, rows))), pa.string())
                ids = pc.binary_join_element_wise("id-", pc.utf8_lpad(numbers, 12, "0"), "")
                writer.write_table(pa.table({"id": ids}))
    return path


WORKERS = {"ids": id_pass, "decode": decode_pass, "tokenize": tokenize_only}


def peak_mb() -> float:
    """This process's peak RSS since exec (VmHWM). Not ru_maxrss: a child started by fork or vfork inherits the
    parent's high-water mark in it, and this driver holds the generated dataset."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--id-rows", type=int, nargs="*", default=[10_000_000, 50_000_000])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bp-planning"))
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({**WORKERS[args.worker](args.input), "peak_mb": peak_mb()}))
        return
    data = generate(args.dir / f"prompts-{args.rows}.parquet", args.rows)
    print(f"{args.rows:,} prompts ({data.stat().st_size / 2**20:.0f} MB of Parquet)")
    print("| pass | wall s | CPU s | peak MB |\n|---|---:|---:|---:|")
    for worker in ("ids", "decode", "tokenize"):
        wall, cpu, _, result = measure([__file__, "--worker", worker, "--input", str(data)])
        print(f"| {worker} | {wall:.1f} | {cpu:.1f} | {result['peak_mb']:.0f} |", flush=True)
    print("\n| string ids | Parquet MB | wall s | CPU s | peak MB |\n|---:|---:|---:|---:|---:|")
    for rows in args.id_rows:
        path = string_ids(args.dir / f"ids-{rows}.parquet", rows)
        wall, cpu, _, result = measure([__file__, "--worker", "ids", "--input", str(path)])
        print(f"| {rows:,} | {path.stat().st_size / 2**20:.0f} | {wall:.1f} | {cpu:.1f} | {result['peak_mb']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
