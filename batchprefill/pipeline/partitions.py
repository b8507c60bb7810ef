"""Stream the input once: tokenize in batches, turn bad rows into errors, and spill rows into partitions.

With `data.order=prefix`, a row's partition is a hash of its namespace and first full KV block, so
prompts that share any block always land together and each partition can be sorted on its own; with
`data.order=input` partitions are contiguous ranges of rows. Partitions are Parquet files under the
output folder, written once and reused by every shard and every resumed run.

Reading, tokenizing and spilling overlap, so preparing takes about the tokenizer's time: the input is
decoded once, a few record batches ahead, tokenized on every core, and spilled as the tokenizer works.

Memory is bounded whatever the input's size: a few record batches are in flight at a time, rows wait for
their partition file in buffers with a fixed total, and partitions are made small enough that the
largest, read back and ordered, fits `data.buffer_mb`.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import math
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from tqdm import tqdm

from batchprefill.errors import JobError
from batchprefill.io.dataset import Columns, check_columns, open_dataset, record_batches
from batchprefill.io.openai_batch import OpenAIBatchFile
from batchprefill.io.unique_ids import check_unique_ids
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.units import readable_bytes

ROW, TOKENS, ERROR, NAMESPACE = "_bp_row", "_bp_tokens", "_bp_error", "_bp_namespace"
CHOICES = "_bp_choices"  # task=score: each choice's token ids after the context
INTERNAL = (ROW, TOKENS, ERROR, NAMESPACE, CHOICES)
# Peak memory while one partition is read back and ordered, per byte of its Arrow table: Parquet decoding,
# the table, the sort key (a copy of the token ids), the table taken in run order, the comparison scratch
# (measured 4.0 to 4.7 on benchmarks/planning_scale.py's partitions).
RUN_EXPANSION = 5
# Partitions are aimed at this size even when the buffer allows more: smaller ones lose no cache hits
# (a prefix group never spans two) and let shards balance; hash skew can make one several times larger.
PARTITION_TARGET_BYTES = 64 << 20
SPILL_BUFFER_SHARE = 8  # rows waiting for their partition file hold at most data.buffer_mb / 8 in all
PARTITIONS_PER_SHARD = 4  # the least a sharded job asks for, so whole partitions can balance its shards
# The ids are checked in a pass of their own that reads only their column (a fraction of the input's bytes),
# so a repeated or null id fails the job before any prompt is tokenized.
ID_READ_ROWS = 1 << 16  # 1 << 20 let pyarrow's scanner read ahead to 800 MB on 50M string ids; this, 130 MB
ENCODE_ROWS = 1024  # rows per tokenizer call: enough to keep every core busy, few enough to bound its output
# Threads that tokenize record batches. The tokenizer spreads each call over every core by itself; a second
# thread keeps those cores fed while the first holds the GIL to turn its output into arrays.
TOKENIZE_THREADS = 2

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
    min_partitions: int = 1  # e.g. a few per shard, so that shards balance; not part of the fingerprint


@dataclass
class Manifest:
    fingerprint: str
    num_rows: int
    partition_rows: list[int]
    partition_tokens: list[int]
    partition_bytes: list[int] = field(default_factory=list)  # Arrow bytes of each partition once read back

    @property
    def num_partitions(self) -> int:
        return len(self.partition_rows)


def partition_path(folder: Path, index: int) -> Path:
    return folder / f"part-{index:05d}.parquet"


def partition_records(manifest: Manifest, shards: list[list[int]]) -> list[dict]:
    """One row per partition for `stats/partitions.parquet` (PARTITION_SCHEMA): its size and its shard."""
    shard_of = {part: shard for shard, parts in enumerate(shards) for part in parts}
    sizes = manifest.partition_bytes or [None] * manifest.num_partitions
    return [{"partition": part, "rows": rows, "prompt_tokens": tokens, "bytes": size, "shard": shard_of[part]}
            for part, (rows, tokens, size) in enumerate(zip(manifest.partition_rows, manifest.partition_tokens,
                                                           sizes))]


def prepare(files: list[Path], fmt: str, settings: PrepareSettings, tokenizer: PromptTokenizer,
            folder: Path, progress: bool = True, workers: int = TOKENIZE_THREADS) -> Manifest:
    """Partitions for this input and these settings, made now unless an earlier run left them complete.

    Any number of tokenizing `workers` makes the same partitions, row for row.
    """
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
        manifest = _spill(files, fmt, settings, tokenizer, staging, fingerprint, progress, workers)
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
    """What the partitions' content depends on; how many there are is left out, as any count serves any job."""
    recipe = {key: value for key, value in asdict(settings).items() if key != "min_partitions"}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _spill(files, fmt, settings: PrepareSettings, tokenizer, staging: Path, fingerprint: str,
           progress: bool, workers: int) -> Manifest:
    """One pass over the input in three overlapping stages: pyarrow's scanner decodes the next record batches,
    `workers` threads tokenize, and this thread spills each tokenized batch, in input order, to its partitions."""
    dataset = open_dataset(files, fmt)
    check_columns(dataset.schema, settings.columns)
    num_rows = dataset.count_rows()
    if num_rows == 0:
        raise JobError("the input has no rows")
    if settings.columns.id in dataset.schema.names:  # when absent, the row's position is its id: unique by itself
        ids = record_batches(dataset, ID_READ_ROWS, [settings.columns.id])
        check_unique_ids((batch.column(0) for batch in ids), settings.columns.id, staging / "ids", num_rows)
    bar = tqdm(total=num_rows, desc="tokenize", unit="row", disable=not progress)
    with _tokenized_tables(dataset, settings, tokenizer, workers) as tables:
        first = next(tables)
        num_partitions = _num_partitions(_expected_bytes(dataset, first, num_rows), settings)
        files_out = _PartitionFiles(staging, num_partitions, (settings.buffer_mb << 20) // SPILL_BUFFER_SHARE)
        try:
            for table in itertools.chain([first], tables):
                files_out.add(table, _partition_of(table, num_partitions, num_rows, settings))
                bar.update(table.num_rows)
            files_out.finish()
        finally:
            bar.close()
            files_out.close()
    _warn_oversized(files_out.bytes, settings.buffer_mb)
    return Manifest(fingerprint, sum(files_out.rows), files_out.rows, files_out.tokens, files_out.bytes)


@contextmanager
def _tokenized_tables(dataset: pads.Dataset, settings: PrepareSettings, tokenizer,
                      workers: int) -> Iterator[Iterator[pa.Table]]:
    """The input's record batches tokenized by `workers` threads, yielded in input order.

    The tokenizer runs on every core in its own thread pool and releases the GIL, so while one batch is in it
    another thread turns its ids into arrays and the caller spills the batch before. At most 2 x `workers`
    batches are in flight, so memory does not follow the input. A worker's exception is raised where its batch
    is yielded; on the way out, batches not yet started are cancelled and the running ones are waited for.
    """
    with ThreadPoolExecutor(workers, thread_name_prefix="tokenize") as pool:
        pending: deque[Future[pa.Table]] = deque()

        def tables() -> Iterator[pa.Table]:
            offset = 0
            for batch in record_batches(dataset, settings.read_batch_rows):
                pending.append(pool.submit(_tokenized, batch, offset, settings, tokenizer))
                offset += batch.num_rows
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

        try:
            yield tables()
        finally:
            for future in pending:
                future.cancel()


def _expected_bytes(dataset: pads.Dataset | OpenAIBatchFile, first: pa.Table, num_rows: int) -> float:
    """The tokenized input's Arrow bytes, guessed from its first batch without reading the rest: scaled by rows,
    or by the share of the input's bytes that the Parquet footers put in those rows, whichever is larger.

    Rows alone miss a head of short prompts; footers alone miss a tail that Parquet's dictionary encoding
    shrinks but Arrow holds in full. Measuring exactly took a decoding pass (0.5 CPU s per 20k prompts against
    the tokenizer's 25, but alone on the critical path).
    """
    by_rows = first.nbytes * num_rows / first.num_rows
    share = _parquet_share(dataset, first.num_rows)
    return by_rows if share is None else max(by_rows, first.nbytes / share)


def _parquet_share(dataset: pads.Dataset | OpenAIBatchFile, rows: int) -> float | None:
    """The share of the input's uncompressed Parquet bytes in its first `rows` rows, from the row groups' sizes
    in the footers (rows within a row group taken as equal); None when the input is not all Parquet."""
    if not isinstance(dataset, pads.Dataset):  # an OpenAI batch file streams JSONL: no footers
        return None
    groups = []  # (rows, bytes) of every row group, in reading order
    for fragment in dataset.get_fragments():
        if not isinstance(fragment, pads.ParquetFileFragment):
            return None
        metadata = fragment.metadata
        groups += [(group.num_rows, group.total_byte_size)
                   for group in map(metadata.row_group, range(metadata.num_row_groups))]
    head, left = 0.0, rows
    for group_rows, size in groups:
        taken = min(left, group_rows)
        head += size * taken / max(group_rows, 1)
        left -= taken
        if not left:
            break
    total = sum(size for _, size in groups)
    return head / total if head and total else None


def _num_partitions(expected_bytes: float, settings: PrepareSettings) -> int:
    """Enough partitions that a typical one, ordered in memory, takes a fraction of data.buffer_mb."""
    target = min(PARTITION_TARGET_BYTES, (settings.buffer_mb << 20) / RUN_EXPANSION)
    return max(settings.min_partitions, math.ceil(expected_bytes / target))


def _warn_oversized(partition_bytes: list[int], buffer_mb: int) -> None:
    """A prefix group is never split, so one first block shared by most of the data makes a large partition."""
    largest = max(partition_bytes, default=0)
    if largest * RUN_EXPANSION > buffer_mb << 20:
        print(f"batchprefill: warning: partition {partition_bytes.index(largest)} holds {readable_bytes(largest)} "
              f"of prompts that share their first block; ordering it needs about "
              f"{readable_bytes(largest * RUN_EXPANSION)}, more than data.buffer_mb={buffer_mb}", file=sys.stderr)


def _tokenized(batch: pa.RecordBatch, offset: int, settings: PrepareSettings, tokenizer) -> pa.Table:
    """The batch with its row numbers, token ids, namespace and, for rows that cannot run, an error."""
    columns = settings.columns
    table = pa.Table.from_batches([batch])
    row_numbers = np.arange(offset, offset + batch.num_rows, dtype=np.int64)
    if columns.id not in table.column_names:
        table = table.append_column(columns.id, pa.array(row_numbers))
    texts, errors = _texts(table, settings, tokenizer)
    spaces = None
    if columns.choices:  # lm-eval's split: the context's trailing whitespace begins every choice
        spaces = [text[len(text.rstrip()):] for text in texts]
        texts = [text.rstrip() for text in texts]
    tokens = _token_column(texts, errors, settings.max_prompt_tokens, tokenizer)
    if columns.choices:
        choices = choice_tokens(table[columns.choices].to_pylist(), texts, spaces, tokens.to_pylist(), errors,
                                settings.max_prompt_tokens, tokenizer)
        table = table.append_column(CHOICES, pa.array(choices, pa.list_(pa.list_(pa.int32()))))
    if columns.namespace:
        namespaces = pc.fill_null(pc.cast(table[columns.namespace], pa.string()), "")
    else:
        namespaces = pa.array(np.full(batch.num_rows, ""), pa.string())
    return (table.append_column(ROW, pa.array(row_numbers))
            .append_column(TOKENS, tokens)
            .append_column(ERROR, pa.array(errors, type=pa.string()))
            .append_column(NAMESPACE, namespaces))


def _texts(table: pa.Table, settings: PrepareSettings, tokenizer) -> tuple[list[str], list[str | None]]:
    """The text to tokenize per row (empty for rows already in error) and each row's error so far.

    A row's conversation, when the input has a messages column and the row has one, is rendered with the chat
    template; otherwise its prompt (OpenAI batch files mix chat lines, with messages, and completion lines).
    """
    columns = settings.columns
    num_rows = table.num_rows
    prompts = table[columns.prompt].to_pylist() if columns.prompt else [None] * num_rows
    conversations = table[columns.messages].to_pylist() if columns.messages else [None] * num_rows
    read_errors = table[columns.read_error].to_pylist() if columns.read_error else [None] * num_rows
    systems = table[columns.system].to_pylist() if columns.system else [None] * num_rows
    texts, errors = [], []
    for prompt, conversation, read_error, system in zip(prompts, conversations, read_errors, systems):
        text, error = "", read_error
        if error is None and (conversation is not None or not columns.prompt):
            error = _conversation_error(conversation)
            if error is None:
                text, error = _rendered(tokenizer.render_conversation, conversation)
        elif error is None:
            error = _prompt_error(prompt)
            if error is None and settings.chat_template:
                text, error = _rendered(tokenizer.apply_chat_template, prompt,
                                        system if isinstance(system, str) else None)
            elif error is None:
                text = prompt
        texts.append(text)
        errors.append(error)
    return texts, errors


def _rendered(render, *args) -> tuple[str, str | None]:
    try:
        return render(*args), None
    except Exception as error:  # noqa: BLE001 - a template failure belongs to this row alone
        return "", f"chat template failed: {error}"


def _conversation_error(conversation) -> str | None:
    """Why a conversation cannot be rendered, or None: a non-empty list of messages with a role and a text."""
    if conversation is None:
        return "messages is null"
    if not isinstance(conversation, list) or not conversation:
        return "messages is empty" if isinstance(conversation, list) else "messages is not a list"
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            return f"messages[{index}] is not an object with role and content"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"messages[{index}] has no role"
        if not isinstance(content, str):
            return f"messages[{index}] ({role}) has no text content"
    if all(not message["content"].strip() for message in conversation):
        return "messages hold no text"
    return None


def _prompt_error(prompt) -> str | None:
    if prompt is None:
        return "prompt is null"
    if not isinstance(prompt, str):
        return f"prompt is a {type(prompt).__name__}, not a string"
    if not prompt or prompt.isspace():
        return "prompt is empty or whitespace only"
    return None


def _token_column(texts: list[str], errors: list[str | None], limit: int, tokenizer) -> pa.ListArray:
    """Token ids as one Arrow list column; rows that tokenize to nothing or to more than `limit` tokens become
    errors, and error rows get no tokens.

    The tokenizer's output (an object per row, Python ints per token: about 100 bytes a token) lives for
    ENCODE_ROWS rows at a time, flattened into numpy at once, so it does not multiply a large read batch.
    """
    lengths, values = [], []
    for start in range(0, len(texts), ENCODE_ROWS):
        token_ids = tokenizer.encode_batch(texts[start : start + ENCODE_ROWS])
        counts = np.fromiter(map(len, token_ids), np.int64, len(token_ids))
        for i in np.flatnonzero((counts == 0) | (counts > limit)):
            if errors[start + i] is None:
                errors[start + i] = "prompt tokenizes to no tokens" if counts[i] == 0 else (
                    f"prompt has {counts[i]} tokens; at most {limit} fit (model context minus sampling.max_tokens)")
        keep = np.fromiter((error is None for error in errors[start : start + len(token_ids)]), bool)
        counts[~keep] = 0
        kept = itertools.compress(token_ids, keep)
        values.append(np.fromiter(itertools.chain.from_iterable(kept), np.int32, int(counts.sum())))
        lengths.append(counts)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(values)))


def choice_tokens(choices: list, contexts: list[str], spaces: list[str], context_tokens: list[list[int]],
                  errors: list[str | None], limit: int, tokenizer) -> list[list[list[int]] | None]:
    """Each row's choices as lm-evaluation-harness tokenizes them: the tokens of context + whitespace + choice
    after the context's own tokens. A row with no choices, a null or empty choice, a choice that adds no token,
    or a context and choice longer than `limit` (the model's context) gets an error instead."""
    texts, owners = [], []
    for row, (row_choices, error) in enumerate(zip(choices, errors)):
        if error is not None:
            continue
        row_choices = [row_choices] if isinstance(row_choices, str) else row_choices
        problem = _choices_error(row_choices)
        if problem is not None:
            errors[row] = problem
            continue
        texts += [contexts[row] + spaces[row] + choice for choice in row_choices]
        owners += [row] * len(row_choices)
    result: list[list[list[int]] | None] = [None] * len(choices)
    for start in range(0, len(texts), ENCODE_ROWS):
        encoded = tokenizer.encode_batch(texts[start : start + ENCODE_ROWS])
        for row, whole in zip(owners[start : start + ENCODE_ROWS], encoded):
            if errors[row] is not None:
                continue
            context = context_tokens[row]
            choice = whole[len(context):]
            index = len(result[row] or [])
            if not choice:
                errors[row] = f"choices[{index}] adds no token to the prompt"
            elif len(context) + len(choice) > limit:
                errors[row] = (f"prompt plus choices[{index}] have {len(context) + len(choice)} tokens; at most "
                               f"{limit} fit (the model's context)")
            else:
                result[row] = [*(result[row] or []), choice]
    return [None if error is not None else row for row, error in zip(result, errors)]


def _choices_error(choices) -> str | None:
    if choices is None:
        return "choices is null"
    if not isinstance(choices, list) or not choices:
        return "choices is empty" if isinstance(choices, list) else f"choices is a {type(choices).__name__}"
    for index, choice in enumerate(choices):
        if choice is None:
            return f"choices[{index}] is null"
        if not isinstance(choice, str) or not choice:
            return f"choices[{index}] is empty" if choice == "" else f"choices[{index}] is not a string"
    return None


def _partition_of(table: pa.Table, num_partitions: int, num_rows: int, settings: PrepareSettings) -> np.ndarray:
    rows = table[ROW].to_numpy()
    if num_partitions == 1:
        return np.zeros(len(rows), dtype=np.int64)
    if settings.order == "input":
        return rows * num_partitions // max(num_rows, 1)
    return (_first_block_hash(table, settings.block_size) % np.uint64(num_partitions)).astype(np.int64)


_FNV_PRIME = np.uint64(0x100000001B3)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)


def _first_block_hash(table: pa.Table, block_size: int) -> np.ndarray:
    """A 64-bit hash per row of (namespace, first full block), computed for the whole batch at once.

    A row with no full block shares no cached block with anyone, so it is spread by its row number instead.
    """
    tokens = table[TOKENS].combine_chunks()
    offsets = tokens.offsets.to_numpy().astype(np.int64)
    values = tokens.values.to_numpy()
    full = np.diff(offsets) >= block_size
    hashes = table[ROW].to_numpy().astype(np.uint64)
    block = values[offsets[:-1][full, None] + np.arange(block_size)].astype(np.uint64)
    keyed = np.full(len(block), _FNV_OFFSET) ^ _namespace_hashes(table[NAMESPACE])[full]
    for column in block.T:
        keyed = (keyed ^ column) * _FNV_PRIME
    hashes[full] = keyed
    return _mix(hashes)


def _namespace_hashes(namespaces: pa.ChunkedArray) -> np.ndarray:
    """A stable 64-bit hash per row of its namespace; only the distinct names are hashed in Python."""
    encoded = pc.dictionary_encode(namespaces.combine_chunks())
    names = np.array([int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
                      for name in encoded.dictionary.to_pylist()], dtype=np.uint64)
    return names[encoded.indices.to_numpy(zero_copy_only=False)]


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches the low bits that `% num_partitions` keeps."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class _PartitionFiles:
    """Rows to their partitions' Parquet files, through buffers that together stay under `budget` bytes.

    Every Parquet write makes a row group, so writing each batch's share at once would make row groups of a
    few rows; a partition's rows wait until it holds budget / partitions bytes, then go out in one write.
    Every partition gets a file, an empty one if no row hashes to it, so readers need not check.
    """

    def __init__(self, folder: Path, count: int, budget: int):
        self.folder = folder
        self.limit = max(1, budget // count)
        self.rows = [0] * count
        self.tokens = [0] * count
        self.bytes = [0] * count
        self.pending: list[list[pa.Table]] = [[] for _ in range(count)]
        self.pending_bytes = [0] * count
        self.writers: dict[int, pq.ParquetWriter] = {}
        self.schema: pa.Schema | None = None

    def add(self, table: pa.Table, parts: np.ndarray) -> None:
        self.schema = table.schema
        order = np.argsort(parts, kind="stable")
        bounds = np.searchsorted(parts[order], np.arange(len(self.rows) + 1))
        lengths = pc.list_value_length(table[TOKENS]).to_numpy(zero_copy_only=False)
        tokens = np.bincount(parts, weights=lengths, minlength=len(self.rows))
        for part in np.flatnonzero(np.diff(bounds)):
            piece = table.take(order[bounds[part] : bounds[part + 1]])  # a compact copy: the batch can go
            self.pending[part].append(piece)
            self.pending_bytes[part] += piece.nbytes
            self.rows[part] += piece.num_rows
            self.tokens[part] += int(tokens[part])
            self.bytes[part] += piece.nbytes
            if self.pending_bytes[part] >= self.limit:
                self._flush(int(part))

    def _flush(self, part: int) -> None:
        table = pa.concat_tables(self.pending[part]) if self.pending[part] else self.schema.empty_table()
        if part not in self.writers:
            self.writers[part] = pq.ParquetWriter(partition_path(self.folder, part), table.schema)
        self.writers[part].write_table(table)
        self.pending[part] = []
        self.pending_bytes[part] = 0

    def finish(self) -> None:
        """Write what still waits, and an empty file for every partition no row went to."""
        for part in range(len(self.rows)):
            if self.pending[part] or part not in self.writers:
                self._flush(part)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
