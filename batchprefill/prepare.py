"""Stream the input once: tokenize in batches, turn bad rows into errors, and spill rows into partitions.

With `data.order=prefix`, a row's partition is a hash of its namespace and first full KV block, so
prompts that share any block always land together and each partition can be sorted on its own; with
`data.order=input` partitions are contiguous ranges of rows. Partitions are Parquet files under the
output folder, written once and reused by every shard and every resumed run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from batchprefill.dataset import Columns, check_columns, open_dataset, record_batches
from batchprefill.errors import JobError
from batchprefill.model.tokenizer import PromptTokenizer

ROW, TOKENS, ERROR, NAMESPACE = "_bp_row", "_bp_tokens", "_bp_error", "_bp_namespace"
INTERNAL = (ROW, TOKENS, ERROR, NAMESPACE)
SPILL_EXPANSION = 4  # bytes in memory per byte of Parquet on disk, roughly, once tokens are added


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


@dataclass
class Manifest:
    fingerprint: str
    num_rows: int
    partition_rows: list[int]
    partition_tokens: list[int]

    @property
    def num_partitions(self) -> int:
        return len(self.partition_rows)


def partition_path(folder: Path, index: int) -> Path:
    return folder / f"part-{index:05d}.parquet"


def prepare(files: list[Path], fmt: str, settings: PrepareSettings, tokenizer: PromptTokenizer,
            folder: Path, progress: bool = True) -> Manifest:
    """Partitions for this input and these settings, made now unless an earlier run left them complete."""
    fingerprint = _fingerprint(files, settings)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / ".prepare.lock"):
        manifest_file = folder / "manifest.json"
        if manifest_file.exists():
            manifest = Manifest(**json.loads(manifest_file.read_text()))
            if manifest.fingerprint == fingerprint:
                return manifest
            shutil.rmtree(folder)  # the input or the settings changed: earlier partitions are stale
        staging = folder.with_name(folder.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        manifest = _spill(files, fmt, settings, tokenizer, staging, fingerprint, progress)
        (staging / "manifest.json").write_text(json.dumps(asdict(manifest)))
        staging.rename(folder)
        return manifest


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process prepares; shards started at the same time wait for it and reuse its partitions."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fingerprint(files: list[Path], settings: PrepareSettings) -> str:
    digest = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True, default=str).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _spill(files, fmt, settings: PrepareSettings, tokenizer, staging: Path, fingerprint: str,
           progress: bool) -> Manifest:
    dataset = open_dataset(files, fmt)
    check_columns(dataset.schema, settings.columns)
    num_rows = dataset.count_rows()
    input_bytes = sum(f.stat().st_size for f in files)
    num_partitions = max(1, math.ceil(input_bytes * SPILL_EXPANSION / (settings.buffer_mb << 20)))
    rows = [0] * num_partitions
    tokens = [0] * num_partitions
    writers: dict[int, pq.ParquetWriter] = {}
    offset = 0
    bar = tqdm(total=num_rows, desc="tokenize", unit="row", disable=not progress)
    try:
        for batch in record_batches(dataset, settings.read_batch_rows):
            table = _tokenized(batch, offset, settings, tokenizer)
            parts = _partition_of(table, num_partitions, num_rows, settings)
            for part in np.unique(parts):
                chosen = table.filter(pa.array(parts == part))
                if part not in writers:
                    writers[part] = pq.ParquetWriter(partition_path(staging, int(part)), chosen.schema)
                writers[part].write_table(chosen)
                rows[part] += chosen.num_rows
                tokens[part] += int(pc.sum(pc.list_value_length(chosen[TOKENS])).as_py() or 0)
            offset += batch.num_rows
            bar.update(batch.num_rows)
    finally:
        bar.close()
        for writer in writers.values():
            writer.close()
    if offset == 0:
        raise JobError("the input has no rows")
    return Manifest(fingerprint, offset, rows, tokens)


def _tokenized(batch: pa.RecordBatch, offset: int, settings: PrepareSettings, tokenizer) -> pa.Table:
    """The batch with its row numbers, token ids, namespace and, for rows that cannot run, an error."""
    columns = settings.columns
    table = pa.Table.from_batches([batch])
    row_numbers = np.arange(offset, offset + batch.num_rows, dtype=np.int64)
    if columns.id not in table.column_names:
        table = table.append_column(columns.id, pa.array(row_numbers))
    prompts = table[columns.prompt].to_pylist()
    systems = table[columns.system].to_pylist() if columns.system else [None] * len(prompts)
    namespaces = table[columns.namespace].to_pylist() if columns.namespace else [None] * len(prompts)
    errors: list[str | None] = [None] * len(prompts)
    texts: list[str] = []
    for i, (prompt, system) in enumerate(zip(prompts, systems)):
        errors[i] = _prompt_error(prompt)
        text = "" if errors[i] else prompt
        if not errors[i] and settings.chat_template:
            try:
                text = tokenizer.apply_chat_template(prompt, system if isinstance(system, str) else None)
            except Exception as error:  # noqa: BLE001 - a template failure belongs to this row alone
                errors[i], text = f"chat template failed: {error}", ""
        texts.append(text)
    token_ids = tokenizer.encode_batch(texts)
    for i, ids in enumerate(token_ids):
        if errors[i] is None and not ids:
            errors[i] = "prompt tokenizes to no tokens"
        elif errors[i] is None and len(ids) > settings.max_prompt_tokens:
            errors[i] = (f"prompt has {len(ids)} tokens; at most {settings.max_prompt_tokens} fit "
                         "(model context minus sampling.max_tokens)")
        if errors[i] is not None:
            token_ids[i] = []
    return (table.append_column(ROW, pa.array(row_numbers))
            .append_column(TOKENS, pa.array(token_ids, type=pa.list_(pa.int32())))
            .append_column(ERROR, pa.array(errors, type=pa.string()))
            .append_column(NAMESPACE, pa.array(["" if n is None else str(n) for n in namespaces], type=pa.string())))


def _prompt_error(prompt) -> str | None:
    if prompt is None:
        return "prompt is null"
    if not isinstance(prompt, str):
        return f"prompt is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return "prompt is empty or whitespace only"
    return None


def _partition_of(table: pa.Table, num_partitions: int, num_rows: int, settings: PrepareSettings) -> np.ndarray:
    rows = table[ROW].to_numpy()
    if num_partitions == 1:
        return np.zeros(len(rows), dtype=np.int64)
    if settings.order == "input":
        return rows * num_partitions // max(num_rows, 1)
    size = settings.block_size
    parts = np.empty(len(rows), dtype=np.int64)
    for i, (ids, namespace) in enumerate(zip(table[TOKENS].to_pylist(), table[NAMESPACE].to_pylist())):
        key = ids[:size] if len(ids) >= size else ids  # with no full block it shares nothing: anywhere
        digest = hashlib.blake2b(namespace.encode() + np.asarray(key, np.int32).tobytes(), digest_size=8)
        parts[i] = int.from_bytes(digest.digest(), "little") % num_partitions
    return parts
