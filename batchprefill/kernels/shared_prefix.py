"""Which sequences of a step share leading KV blocks: the grouping every backend's shared-prefix attention starts from.

In a prefix-ordered batch many sequences point at the same physical blocks for their shared prefix (a system
prompt, a document). The torch and C++ paths (kernels/torch, kernels/native) and the Triton shared-prefix decode
(kernels/triton/shared_decode.py) all group by the deepest run of leading blocks a sequence shares with another,
so they live here, below all of them. Host-side numpy only: the block tables come from the host, never read back
from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchprefill.kernels.interface import AttentionMetadata


def shared_depths(held: np.ndarray) -> np.ndarray:
    """[n] how many leading blocks of each row of `held` ([n, width] block ids, -1 past a row's shareable
    blocks) are held by another row too. Counted with numpy: at 256 decodes of 100 blocks, a dict count per
    block took milliseconds per step."""
    shifted = held + 1  # -1 counts in bin 0, which no real block reads
    holders = np.bincount(shifted.ravel())
    holders[0] = 0
    shared = holders[shifted] > 1
    return np.where(shared.all(axis=1), shared.shape[1], shared.argmin(axis=1))  # the first block not shared


def by_deepest_prefix(meta: AttentionMetadata, seqs: list[int], tables: list[list[int]], block: int
                      ) -> dict[tuple[int, ...], list[int]]:
    """The sequences keyed by the deepest run of leading blocks each shares with another sequence of the set
    (an empty key: it shares none). Only blocks wholly before a sequence's first query count as shared."""
    if not seqs:
        return {}
    limits = [(meta.seq_lens_host[s] - meta.query_lens_host[s]) // block for s in seqs]
    held = np.full((len(seqs), max(max(limits), 1)), -1, dtype=np.int64)
    for i, (s, limit) in enumerate(zip(seqs, limits)):
        row = tables[s][:limit]
        held[i, : len(row)] = row
    depths = shared_depths(held).tolist()
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for i, (s, depth) in enumerate(zip(seqs, depths)):
        by_prefix.setdefault(tuple(held[i, :depth].tolist()), []).append(s)
    return by_prefix


@dataclass
class DecodeGroups:
    """A step's decodes grouped by the full blocks they share, as int32 arrays (numpy on the host, or the device
    tensors a kernel reads). Rows are the decode launch's rows (row i serves the i-th decode of the step)."""

    groups: np.ndarray  # [G, 4]: first index into `members`, member count, shared tokens, table row of the KV
    members: np.ndarray  # [N] launch rows, each group's members contiguous
    shared_lens: np.ndarray  # [rows] shared tokens of each launch row's group (0: the row is in no group)


def group_decodes(seq_lens: np.ndarray, tables: np.ndarray, table_rows: np.ndarray, block: int,
                  max_members: int) -> DecodeGroups | None:
    """Decodes (one query each, launch row i at context `seq_lens[i]`, block table `tables[i]`) grouped by the
    deepest run of full blocks before their query that they share; None when no two share a block.

    A group of more than `max_members` is cut into near-equal sub-groups (each of at least 2 members when
    `max_members` >= 4, so there are at most rows // 2 of them), the longest prefixes first; a group's shared KV is
    addressed through its first member's table, whose index in the step is `table_rows[i]`. All numpy, no loop
    over rows or groups: the padded decode plans every step with it (0.2 ms at 511 decodes in 16 groups)."""
    limits = (np.asarray(seq_lens, dtype=np.int64) - 1) // block
    width = int(limits.max(initial=0))
    if width == 0:
        return None
    held = np.where(np.arange(width) < limits[:, None], tables[:, :width], -1)
    depths = shared_depths(held)
    grouped = np.flatnonzero(depths > 0)
    if len(grouped) < 2:
        return None
    labels = _prefix_labels(held[grouped], depths[grouped])
    order = np.lexsort((labels, -depths[grouped]))  # the longest prefixes first: their programs start first
    members, labels = grouped[order], labels[order]
    starts = np.flatnonzero(np.concatenate([[True], labels[1:] != labels[:-1]]))
    counts = np.diff(np.concatenate([starts, [len(labels)]]))
    kept = counts > 1
    if not kept.any():
        return None
    members = members[np.repeat(kept, counts)].astype(np.int32)
    counts = counts[kept]
    firsts = np.cumsum(counts) - counts
    # sub-groups: part k of a group of n in p parts has n // p members, one more for the first n % p parts
    parts = -(-counts // max_members)
    group = np.repeat(np.arange(len(counts)), parts)
    part = np.arange(len(group)) - np.repeat(np.cumsum(parts) - parts, parts)
    base, extra = counts[group] // parts[group], counts[group] % parts[group]
    sizes = base + (part < extra)
    offsets = firsts[group] + part * base + np.minimum(part, extra)
    shared = depths[members[firsts]] * block
    groups = np.stack([offsets, sizes, shared[group], np.asarray(table_rows)[members[offsets]]], axis=1)
    shared_lens = np.zeros(len(seq_lens), dtype=np.int32)
    shared_lens[members] = np.repeat(shared, counts)
    return DecodeGroups(groups.astype(np.int32), members, shared_lens)


def _prefix_labels(held: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """A label per row, equal for rows whose first `depth` blocks are the same. Keyed by (depth, last shared
    block), which decides it where the prefix cache built the tables (a block follows the same blocks in every
    table that holds it); checked against the rows, and rows compared whole (a slower sort) where it does not."""
    last = held[np.arange(len(held)), depths - 1]
    labels = np.unique(last.astype(np.int64) * (held.shape[1] + 1) + depths, return_inverse=True)[1].reshape(-1)
    prefixes = np.where(np.arange(held.shape[1]) < depths[:, None], held, -1)
    first = np.zeros(labels.max() + 1, dtype=np.int64)
    first[labels[::-1]] = np.arange(len(labels))[::-1]
    if (prefixes == prefixes[first[labels]]).all():
        return labels
    return np.unique(prefixes, axis=0, return_inverse=True)[1].reshape(-1)
