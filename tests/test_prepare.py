"""The preparation stage: streaming into partitions, error rows, manifest reuse, prefix order, groups, shards.

A word-level tokenizer built here (one token per word) keeps lengths exact and needs no model files.
Timing and peak memory belong to benchmarks/cpu/planning_scale.py, not here.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from batchprefill.io.columns import ERROR, NAMESPACE, ROW, TOKENS, Columns
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline import partitions as prepare_module
from batchprefill.pipeline import tokenize as tokenize_module
from batchprefill.pipeline.manifest import PrepareSettings, partition_path, partition_records
from batchprefill.pipeline.order import Group, assign_shards, groups, prefix_order, reusable_tokens
from batchprefill.pipeline.partitions import PARTITION_TARGET_BYTES, RUN_EXPANSION, make_partitions

VOCAB = 8
BLOCK = 2
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> PromptTokenizer:
    """Words w0..w7 are tokens 0..7, split on whitespace: a prompt of n words is n tokens."""
    vocab = {f"w{i}": i for i in range(VOCAB)} | {"[UNK]": VOCAB}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("words")
    tokenizer.save(str(folder / "tokenizer.json"))
    return PromptTokenizer(folder)


def _settings(min_partitions: int = 5, order: str = "prefix", namespace: str | None = "ns") -> PrepareSettings:
    return PrepareSettings(columns=Columns(prompt="prompt", id="id", system=None, namespace=namespace),
                           chat_template=False, order=order, block_size=BLOCK, max_prompt_tokens=MAX_TOKENS,
                           tokenizer_id="words", read_batch_rows=7, buffer_mb=1, min_partitions=min_partitions)


def _write(path: Path, prompts: list, namespaces: list[str], row_group_rows: int | None = None) -> Path:
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": pa.array(prompts, pa.string()),
                             "ns": namespaces}), path, row_group_size=row_group_rows)
    return path


def _partitions(folder: Path, count: int) -> list[pa.Table]:
    return [pq.read_table(partition_path(folder, part)) for part in range(count)]


def _prepare(words, source: Path, folder: Path, **kwargs):
    manifest = make_partitions([source], "parquet", _settings(**kwargs), words, folder, progress=False)
    return manifest, _partitions(folder, manifest.num_partitions)


token_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_TOKENS)


@settings(max_examples=25, deadline=None)
@given(bases=st.lists(token_lists, min_size=1, max_size=4), data=st.data(), count=st.integers(1, 40),
       parts=st.integers(1, 6))
def test_every_row_lands_in_one_partition_with_every_row_sharing_its_first_block(words, bases, data, count, parts):
    rows = [data.draw(st.sampled_from(bases)) + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
            for _ in range(count)]
    rows = [ids[:MAX_TOKENS] for ids in rows]
    namespaces = data.draw(st.lists(st.sampled_from(["", "a"]), min_size=count, max_size=count))
    with tempfile.TemporaryDirectory() as tmp:
        source = _write(Path(tmp) / "in.parquet", [" ".join(f"w{t}" for t in ids) for ids in rows], namespaces)
        manifest, tables = _prepare(words, source, Path(tmp) / "partitions", min_partitions=parts)
    assert manifest.num_partitions == parts and manifest.num_rows == count
    where: dict[int, int] = {}
    for part, table in enumerate(tables):
        assert table.num_rows == manifest.partition_rows[part]
        assert sum(map(len, table[TOKENS].to_pylist())) == manifest.partition_tokens[part]
        for row, ids in zip(table[ROW].to_pylist(), table[TOKENS].to_pylist()):
            assert row not in where and ids == rows[row]
            where[row] = part
    assert sorted(where) == list(range(count))
    for i in range(count):
        for j in range(count):
            if namespaces[i] == namespaces[j] and shared_blocks(rows[i], rows[j], BLOCK) > 0:
                assert where[i] == where[j]


def test_error_rows_are_kept_with_their_message_and_no_tokens(words, tmp_path):
    prompts = ["w1 w2 w3", None, "", "   \n", " ".join(["w1"] * (MAX_TOKENS + 1)), "w1 w2"]
    manifest, tables = _prepare(words, _write(tmp_path / "in.parquet", prompts, [""] * 6), tmp_path / "p")
    rows = {r[ROW]: r for t in tables for r in t.select([ROW, ERROR, TOKENS]).to_pylist()}
    assert [rows[i][ERROR] for i in range(6)] == [
        None, "prompt is null", "prompt is empty or whitespace only", "prompt is empty or whitespace only",
        f"prompt has {MAX_TOKENS + 1} tokens; at most {MAX_TOKENS} fit (model context minus sampling.max_tokens)",
        None]
    assert [len(rows[i][TOKENS]) for i in range(6)] == [3, 0, 0, 0, 0, 2]
    assert sum(manifest.partition_tokens) == 5


def test_input_order_makes_contiguous_ranges(words, tmp_path):
    prompts = [f"w{i % VOCAB} w1 w2" for i in range(30)]
    _, tables = _prepare(words, _write(tmp_path / "in.parquet", prompts, [""] * 30), tmp_path / "p",
                         order="input", min_partitions=4)
    ranges = [t[ROW].to_pylist() for t in tables]
    assert sum(ranges, []) == list(range(30)) and all(len(r) > 0 for r in ranges)


def test_a_rerun_reuses_the_manifest_and_a_changed_input_prepares_again(words, tmp_path, monkeypatch):
    source = _write(tmp_path / "in.parquet", ["w1 w2 w3"] * 10, [""] * 10)
    first, _ = _prepare(words, source, tmp_path / "p")
    with monkeypatch.context() as patched:
        patched.setattr("batchprefill.pipeline.partitions._spill", lambda *args: pytest.fail("prepared again"))
        assert _prepare(words, source, tmp_path / "p", min_partitions=3)[0] == first  # the count is no reason
    _write(source, ["w1 w2 w3"] * 12, [""] * 12)
    again, tables = _prepare(words, source, tmp_path / "p")
    assert again.num_rows == 12 and again.fingerprint != first.fingerprint
    assert sum(t.num_rows for t in tables) == 12


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), max_size=30), num_shards=st.integers(1, 8))
def test_shards_take_whole_partitions_once_and_balance(tokens, num_shards):
    shards = assign_shards(tokens, num_shards)
    assert len(shards) == num_shards
    assert sorted(p for shard in shards for p in shard) == list(range(len(tokens)))
    loads = [sum(tokens[p] for p in shard) for shard in shards]
    assert max(loads) <= sum(tokens) / num_shards + max(tokens, default=0)


def test_partition_records_name_each_partition_and_its_shard(words, tmp_path):
    prompts = [f"w{i % VOCAB} w{i % 3} w2 w3" for i in range(40)]
    manifest, _ = _prepare(words, _write(tmp_path / "in.parquet", prompts, [""] * 40), tmp_path / "p")
    shards = assign_shards(manifest.partition_tokens, 2)
    records = partition_records(manifest, shards)
    assert [r["partition"] for r in records] == list(range(manifest.num_partitions))
    assert sum(r["rows"] for r in records) == 40
    assert all(r["partition"] in shards[r["shard"]] for r in records)


def shared_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """The definition the vectorised counters in order.py are checked against: leading full blocks in common."""
    blocks = 0
    while (blocks + 1) * block_size <= min(len(a), len(b)) and \
            a[blocks * block_size : (blocks + 1) * block_size] == b[blocks * block_size : (blocks + 1) * block_size]:
        blocks += 1
    return blocks


def _reference_groups(token_ids: list[list[int]], namespaces: list[str], block_size: int) -> list[Group]:
    """The definition, one row at a time: join the group if sharing a first block with its first row."""
    result: list[Group] = []
    for i, ids in enumerate(token_ids):
        if (result and namespaces[i] == namespaces[i - 1] and result[-1].shared_prefix_tokens > 0
                and shared_blocks(token_ids[result[-1].start], ids, block_size) > 0):
            group = result[-1]
            shared = shared_blocks(token_ids[group.start], ids, block_size) * block_size
            group.shared_prefix_tokens = min(group.shared_prefix_tokens, shared)
            group.stop = i + 1
        else:
            result.append(Group(i, i + 1, (len(ids) // block_size) * block_size))
    for group in result:
        if group.stop - group.start == 1:
            group.shared_prefix_tokens = 0
    return result


def _reference_reuse(token_ids: list[list[int]], namespaces: list[str], block_size: int) -> list[int]:
    return [0 if i == 0 or namespaces[i] != namespaces[i - 1] else
            min(shared_blocks(token_ids[i - 1], ids, block_size), (len(ids) - 1) // block_size) * block_size
            for i, ids in enumerate(token_ids)]


@settings(max_examples=200, deadline=None)
@given(bases=st.lists(st.lists(st.integers(0, 3), max_size=10), min_size=1, max_size=3), data=st.data(),
       block_size=st.sampled_from([1, 2, 4]), arrow=st.booleans())
def test_order_groups_and_reuse_match_their_definitions(bases, data, block_size, arrow):
    rows = data.draw(st.lists(st.builds(lambda base, cut, tail: (base[:cut] + tail) or [0], st.sampled_from(bases),
                                        st.integers(0, 10), st.lists(st.integers(0, 3), max_size=4)), max_size=30))
    names = data.draw(st.lists(st.sampled_from(["", "a", "b"]), min_size=len(rows), max_size=len(rows)))

    def column(lists, strings):
        if not arrow:
            return lists, strings
        return (pa.chunked_array([pa.array(lists, pa.list_(pa.int32()))], pa.list_(pa.int32())),
                pa.chunked_array([pa.array(strings, pa.string())], pa.string()))

    order = prefix_order(*column(rows, names))
    assert order == sorted(range(len(rows)), key=lambda i: (names[i], rows[i]))
    for run in (order, list(range(len(rows)))):  # the prefix order and the input order
        ids, spaces = [rows[i] for i in run], [names[i] for i in run]
        assert groups(*column(ids, spaces), block_size) == _reference_groups(ids, spaces, block_size)
        assert reusable_tokens(*column(ids, spaces), block_size) == _reference_reuse(ids, spaces, block_size)


def test_a_sliced_arrow_column_orders_like_its_lists():
    lists = [[9, 9], [1, 2, 3], [1, 2], [0]]
    column = pa.array(lists, pa.list_(pa.int32())).slice(1)
    assert prefix_order(column, ["", "", ""]) == [2, 1, 0]
    assert groups(column.take([1, 0]), ["", ""], 2) == [Group(0, 2, 2)]


def test_namespaces_come_from_the_namespace_column(words, tmp_path):
    prompts = ["w1 w2 w3"] * 6
    _, tables = _prepare(words, _write(tmp_path / "in.parquet", prompts, ["a", "b"] * 3), tmp_path / "p")
    assert sorted(n for t in tables for n in t[NAMESPACE].to_pylist()) == ["a"] * 3 + ["b"] * 3
    _, tables = _prepare(words, _write(tmp_path / "in2.parquet", prompts, ["a"] * 6), tmp_path / "q",
                         namespace=None)
    assert {n for t in tables for n in t[NAMESPACE].to_pylist()} == {""}


def _varied_prompts(count: int, words: int) -> list[str]:
    """`count` prompts of `words` words each, no two alike in their first block."""
    return [" ".join(f"w{(i >> (3 * k)) % VOCAB}" for k in range(words)) for i in range(count)]


def test_one_and_three_tokenizing_threads_make_the_same_partitions_row_for_row(words, tmp_path):
    prompts = [f"w{i % 5} w{i % 3} w{i % 7} w1" if i % 11 else None for i in range(400)]
    source = _write(tmp_path / "in.parquet", prompts, [("", "a")[i % 2] for i in range(400)])
    one = make_partitions([source], "parquet", _settings(), words, tmp_path / "one", progress=False, workers=1)
    three = make_partitions([source], "parquet", _settings(), words, tmp_path / "three", progress=False, workers=3)
    assert one == three and one.num_partitions == 5  # 400 rows in 58 batches of 7
    for part in range(5):
        assert pq.read_table(partition_path(tmp_path / "one", part)).equals(
            pq.read_table(partition_path(tmp_path / "three", part)))


class _FailingTokenizer(PromptTokenizer):
    """The word tokenizer, except that its third call raises, as a tokenizer bug or a bad input would."""

    def __init__(self, words: PromptTokenizer):
        self.__dict__.update(words.__dict__)
        self.calls = 0
        self.lock = threading.Lock()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        with self.lock:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("tokenizer broke on batch 3")
        return super().encode_batch(texts)


def test_an_exception_in_a_tokenizing_thread_is_raised_by_prepare_and_leaves_no_partitions(words, tmp_path):
    source = _write(tmp_path / "in.parquet", ["w1 w2 w3"] * 200, [""] * 200)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            make_partitions([source], "parquet", _settings(), _FailingTokenizer(words), tmp_path / "p", progress=False,
                    workers=2)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "prepare hung after its tokenizer raised"
    assert [str(error) for error in raised] == ["tokenizer broke on batch 3"]
    assert not (tmp_path / "p").exists()  # no manifest: a rerun prepares from the start
    assert make_partitions([source], "parquet", _settings(), words, tmp_path / "p", progress=False).num_rows == 200


def _prepared_from_one_read(words, source: Path, folder: Path, monkeypatch) -> prepare_module.Manifest:
    reads = []
    original = prepare_module.record_batches
    def counted(*args):  # the whole rows; the id check's pass reads the id column alone
        reads.extend([1] if len(args) < 3 or args[2] is None else [])
        return original(*args)

    monkeypatch.setattr(prepare_module, "record_batches", counted)  # the id check's pass
    monkeypatch.setattr(tokenize_module, "record_batches", counted)  # the rows tokenized
    settings = dataclasses.replace(_settings(min_partitions=1), read_batch_rows=500)
    manifest = make_partitions([source], "parquet", settings, words, folder, progress=False)
    assert len(reads) == 1
    return manifest


def _needed_partitions(manifest: prepare_module.Manifest) -> int:
    target = (1 << 20) / RUN_EXPANSION  # data.buffer_mb=1 aims below PARTITION_TARGET_BYTES
    assert target < PARTITION_TARGET_BYTES
    return math.ceil(sum(manifest.partition_bytes) / target)


def test_a_head_of_short_prompts_still_gets_partitions_for_the_long_tail(words, tmp_path, monkeypatch):
    """8,000 two-word rows, then 8,000 twelve-word ones, in row groups of 2,000: the first 500-row batch scaled
    by rows suggests 4 partitions where 7 are needed; the footers' row-group sizes see the tail."""
    prompts = _varied_prompts(8000, 2) + _varied_prompts(8000, MAX_TOKENS)
    source = _write(tmp_path / "in.parquet", prompts, [""] * 16000, row_group_rows=2000)
    manifest = _prepared_from_one_read(words, source, tmp_path / "p", monkeypatch)
    needed = _needed_partitions(manifest)
    assert needed == 7 and needed <= manifest.num_partitions <= 2 * needed


def test_a_tail_that_parquet_shrinks_by_its_dictionary_still_gets_partitions(words, tmp_path, monkeypatch):
    """8,000 distinct twelve-word rows, then one twelve-word prompt 8,000 times: Parquet stores the tail in a
    few bytes, Arrow in full, so the footers suggest 6 partitions where 10 are needed; the rows' count sees it."""
    prompts = _varied_prompts(8000, MAX_TOKENS) + ["w1 " * (MAX_TOKENS - 1) + "w2"] * 8000
    source = _write(tmp_path / "in.parquet", prompts, [""] * 16000, row_group_rows=2000)
    manifest = _prepared_from_one_read(words, source, tmp_path / "p", monkeypatch)
    needed = _needed_partitions(manifest)
    assert needed == 10 and needed <= manifest.num_partitions <= 2 * needed
