"""Order prompts so that shared prefixes sit together, group them, and split partitions over shards.

Sorting token sequences lexicographically lays a dataset out in the depth-first order of its prefix
trie: every set of prompts sharing a prefix becomes one contiguous run, at every depth. In that order a
prompt's longest shared prefix with any earlier prompt is its shared prefix with the one just before.

A partition holds hundreds of thousands of prompts, so the work is done on flat arrays, never on Python
lists of token ids: Arrow sorts the token sequences as big-endian bytes in C++, and block comparisons
between rows are numpy gathers, one pass per block depth. Every function takes either Python lists or
Arrow list columns (the form partitions are read in), and lists only pay a conversion.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchprefill.io.columns import ERROR, NAMESPACE, ROW, TOKENS

TokenColumn = Sequence[Sequence[int]] | pa.Array | pa.ChunkedArray
NameColumn = Sequence[str] | pa.Array | pa.ChunkedArray


@dataclass
class Group:
    """A maximal run of prompts (in run order) that share at least their first full KV block."""

    start: int
    stop: int
    shared_prefix_tokens: int  # full-block prefix common to every member


@dataclass(frozen=True)
class _Flat:
    """Token sequences as one value array and row offsets into it (row i is values[offsets[i]:offsets[i+1]])."""

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _flat(token_ids: TokenColumn) -> _Flat:
    if isinstance(token_ids, pa.ChunkedArray):
        token_ids = token_ids.combine_chunks() if token_ids.num_chunks else pa.array([], pa.list_(pa.int32()))
    if isinstance(token_ids, pa.Array):
        offsets = token_ids.offsets.to_numpy().astype(np.int64)
        return _Flat(token_ids.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0])
    lengths = np.fromiter(map(len, token_ids), np.int64, len(token_ids))
    values = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, int(lengths.sum()))
    return _Flat(values, np.concatenate([[0], np.cumsum(lengths)]))


def _names(namespaces: NameColumn) -> pa.Array:
    if isinstance(namespaces, pa.ChunkedArray):
        return namespaces.combine_chunks() if namespaces.num_chunks else pa.array([], pa.string())
    return namespaces if isinstance(namespaces, pa.Array) else pa.array(namespaces, pa.string())


def _codes(namespaces: NameColumn) -> np.ndarray:
    """An integer per row, equal exactly where the namespaces are equal: comparisons without strings."""
    return pc.dictionary_encode(_names(namespaces)).indices.to_numpy(zero_copy_only=False)


def prefix_order(token_ids: TokenColumn, namespaces: NameColumn) -> list[int]:
    """Row positions sorted by namespace, then token ids: the depth-first order of the prefix trie.

    Ties keep their input order. The key is each row's tokens as big-endian unsigned 32-bit bytes, whose
    byte order is the numeric order and where a prefix sorts before its extensions, as for lists.
    """
    flat = _flat(token_ids)
    count = len(flat.offsets) - 1
    data = pa.py_buffer(np.ascontiguousarray(flat.values, dtype=">u4"))
    keys = pa.LargeBinaryArray.from_buffers(pa.large_binary(), count, [None, pa.py_buffer(flat.offsets * 4), data])
    table = pa.table({"namespace": _names(namespaces), "tokens": keys, "position": np.arange(count)})
    order = pc.sort_indices(table, sort_keys=[("namespace", "ascending"), ("tokens", "ascending"),
                                              ("position", "ascending")])
    return order.to_numpy().tolist()


def _shared_block_counts(flat: _Flat, a: np.ndarray, b: np.ndarray, block_size: int) -> np.ndarray:
    """Leading full blocks rows a[k] and b[k] have in common, for every k at once: one vectorised comparison per
    block depth.

    Only pairs still equal so far are compared at the next depth, so the work is about the tokens shared.
    """
    lengths = flat.lengths
    limit = np.minimum(lengths[a], lengths[b]) // block_size
    counts = np.zeros(len(a), dtype=np.int64)
    alive = np.flatnonzero(limit > 0)
    span = np.arange(block_size)
    depth = 0
    while alive.size:
        start = depth * block_size + span
        left = flat.values[flat.offsets[a[alive], None] + start]
        right = flat.values[flat.offsets[b[alive], None] + start]
        alive = alive[(left == right).all(axis=1)]
        counts[alive] += 1
        depth += 1
        alive = alive[limit[alive] > depth]
    return counts


def _with_previous(flat: _Flat, codes: np.ndarray, block_size: int) -> np.ndarray:
    """Per row: leading full blocks shared with the row before it in the same namespace (0 for the first)."""
    count = len(codes)
    shared = np.zeros(count, dtype=np.int64)
    if count > 1:
        rows = np.arange(1, count)
        shared[1:] = np.where(codes[1:] == codes[:-1], _shared_block_counts(flat, rows - 1, rows, block_size), 0)
    return shared


def shared_with_previous(token_ids: TokenColumn, namespaces: NameColumn, block_size: int) -> np.ndarray:
    """Per prompt in run order: the leading full blocks it shares with the prompt before it (same namespace)."""
    return _with_previous(_flat(token_ids), _codes(namespaces), block_size)


def reusable_tokens(token_ids: TokenColumn, namespaces: NameColumn, block_size: int) -> list[int]:
    """Per prompt in run order: prompt tokens an ideal cache serves, with one token always left to compute."""
    flat = _flat(token_ids)
    shared = _with_previous(flat, _codes(namespaces), block_size)
    return (np.minimum(shared, np.maximum(flat.lengths - 1, 0) // block_size) * block_size).tolist()


def run_order(token_ids: pa.ChunkedArray, namespaces: pa.ChunkedArray, rows: pa.ChunkedArray,
              errors: pa.ChunkedArray, order: str) -> np.ndarray:
    """Positions of a partition's rows that reach the engine (those without an error), in the order a run
    takes them: the prefix trie's depth-first order, or the input's own order (`data.order=input`)."""
    valid = np.flatnonzero(pc.is_null(errors).to_numpy(zero_copy_only=False))
    if order == "prefix":
        return valid[np.asarray(prefix_order(token_ids.take(valid), namespaces.take(valid)), dtype=np.int64)]
    return valid[np.argsort(rows.to_numpy()[valid], kind="stable")]


@dataclass
class RunOrder:
    """A partition's prompts that reach the engine, in the order a run takes them."""

    order: np.ndarray  # positions in the partition's table, in run order
    token_ids: pa.ChunkedArray  # the prompts' token ids in that order
    namespaces: pa.ChunkedArray


def in_run_order(partition: pa.Table, order: str) -> RunOrder:
    """A partition's rows without an error, ordered as `data.order` asks (run_order), with their prompts: what the
    run's requests and the plan's tally are both made from."""
    run = run_order(partition[TOKENS], partition[NAMESPACE], partition[ROW], partition[ERROR], order)
    return RunOrder(run, partition[TOKENS].take(run), partition[NAMESPACE].take(run))


def groups(token_ids: TokenColumn, namespaces: NameColumn, block_size: int) -> list[Group]:
    """Split a run order into groups: consecutive prompts that share their first full block.

    Sharing a first block is an equivalence, so a row joins the current group exactly when it shares one with
    the row before it; the group's shared prefix is the least any member shares with the group's first row.
    """
    flat = _flat(token_ids)
    count = len(flat.offsets) - 1
    if count == 0:
        return []
    joins = _with_previous(flat, _codes(namespaces), block_size) > 0
    starts = np.flatnonzero(~joins)
    stops = np.append(starts[1:], count)
    members = np.flatnonzero(joins)
    first = starts[np.cumsum(~joins)[members] - 1]
    shared = flat.lengths // block_size
    shared[members] = _shared_block_counts(flat, first, members, block_size)
    prefix = np.minimum.reduceat(shared, starts) * block_size
    prefix[stops - starts == 1] = 0  # a group of one shares nothing
    return [Group(int(s), int(e), int(p)) for s, e, p in zip(starts, stops, prefix)]


def assign_shards(partition_tokens: list[int], num_shards: int) -> list[list[int]]:
    """Whole partitions per shard, balanced by prompt tokens (largest first onto the lightest shard).

    The shard that takes a partition is the lightest, hence at most the mean, so no shard ends more than
    the largest partition above the mean.
    """
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for part in sorted(range(len(partition_tokens)), key=lambda p: (-partition_tokens[p], p)):
        lightest = min(range(num_shards), key=lambda s: (loads[s], s))
        shards[lightest].append(part)
        loads[lightest] += partition_tokens[part]
    return [sorted(s) for s in shards]
