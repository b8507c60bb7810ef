"""What a job's prepared partitions are made from and hold: the recipe (PrepareSettings), its fingerprint, and the
manifest, written under one lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from batchprefill.io.columns import Columns
from batchprefill.io.own_files import read_parquet

PARTITIONS_PER_SHARD = 4  # the least a sharded job asks for, so whole partitions can balance its shards
MANIFEST_NAME = "manifest.json"
PARTITION_REMEDY = "delete output.dir/partitions and rerun: the job prepares them again and resumes"


PARTITION_SCHEMA = pa.schema([("partition", pa.int64()), ("rows", pa.int64()), ("prompt_tokens", pa.int64()),
                              ("bytes", pa.int64()), ("shard", pa.int64())])


@dataclass(frozen=True)
class PrepareSettings:
    columns: Columns
    chat_template: bool
    order: str
    block_size: int
    max_prompt_tokens: int
    tokenizer_id: str
    read_batch_rows: int
    buffer_mb: int
    task: str = "generate"  # what it tokenizes beyond the prompt (tasks.Task.tokenize)
    adapters: tuple[str, ...] = ()  # the names in model.adapters: a row naming another is an error row
    min_partitions: int = 1  # e.g. a few per shard, so that shards balance; not part of the fingerprint
    vocab_size: int | None = None  # token-id prompts must stay below it; tokenizer_id fixes it: not fingerprinted


@dataclass
class Manifest:
    fingerprint: str
    num_rows: int
    partition_rows: list[int]
    partition_tokens: list[int]
    partition_bytes: list[int] = field(default_factory=list)  # Arrow bytes of each partition once read back
    # Every input row's content, in input order (partitions.InputDigest): what a resume compares (job_record.py)
    input_digest: str | None = None

    @property
    def num_partitions(self) -> int:
        return len(self.partition_rows)


def read_manifest(folder: Path) -> Manifest:
    """The manifest of the partitions in `folder`; OSError when there is none, ValueError when it is not JSON."""
    return Manifest(**json.loads((folder / MANIFEST_NAME).read_text()))


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (folder / MANIFEST_NAME).write_text(json.dumps(asdict(manifest)))


def partition_path(folder: Path, index: int) -> Path:
    return folder / f"part-{index:05d}.parquet"


def read_partition(folder: Path, index: int, columns: list[str] | None = None,
                   remedy: str = PARTITION_REMEDY) -> pa.Table:
    """One prepared partition (all its columns, or `columns`); a damaged one stops the job with `remedy`."""
    return read_parquet(partition_path(folder, index), columns, remedy)


def partition_records(manifest: Manifest, shards: list[list[int]]) -> list[dict]:
    """One row per partition for `stats/partitions.parquet` (PARTITION_SCHEMA): its size and its shard."""
    shard_of = {part: shard for shard, parts in enumerate(shards) for part in parts}
    sizes = manifest.partition_bytes or [None] * manifest.num_partitions
    return [{"partition": part, "rows": rows, "prompt_tokens": tokens, "bytes": size, "shard": shard_of[part]}
            for part, (rows, tokens, size) in enumerate(zip(manifest.partition_rows, manifest.partition_tokens,
                                                           sizes))]


@contextmanager
def locked(path: Path, required: bool = True) -> Iterator[None]:
    """One process at a time: one prepares while shards started at the same time wait for it and reuse its
    partitions; one checks and takes a shard's lease (pipeline.shard_lock).

    flock is coherent across hosts on a local disk, NFS (the client turns it into a server-side lock) and Lustre
    mounted with `flock`; Lustre mounted `noflock` refuses it (ENOSYS), where `required=False` goes on unlocked."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            held = True
        except OSError:
            if required:
                raise
            held = False
        try:
            yield
        finally:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)


def recipe_fingerprint(files: list[Path], settings: PrepareSettings) -> str:
    """What the partitions' content depends on; how many there are is left out, as any count serves any job."""
    recipe = {key: value for key, value in asdict(settings).items() if key not in ("min_partitions", "vocab_size")}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
