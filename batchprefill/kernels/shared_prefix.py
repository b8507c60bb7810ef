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
    valid = held >= 0
    holders = np.bincount(held[valid], minlength=1)
    shared = valid & (holders[np.where(valid, held, 0)] > 1)
    return np.cumprod(shared, axis=1).sum(axis=1)


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
    `max_members` >= 4, so there are at most rows // 2 of them); a group's shared KV is addressed through its first
    member's table, whose index in the step is `table_rows[i]`. Sequences sharing blocks at the same depth share
    them all (a shared block follows the same blocks in every table that holds it, as the prefix cache keys a
    block by its whole prefix), but rows are compared whole, so tables that break that still group correctly."""
    limits = (np.asarray(seq_lens, dtype=np.int64) - 1) // block
    width = int(limits.max(initial=0))
    if width == 0:
        return None
    held = np.where(np.arange(width) < limits[:, None], tables[:, :width], -1).astype(np.int64)
    depths = shared_depths(held)
    grouped = np.flatnonzero(depths > 0)
    if len(grouped) < 2:
        return None
    prefixes = np.where(np.arange(width) < depths[grouped, None], held[grouped], -1)
    labels = np.unique(prefixes, axis=0, return_inverse=True)[1].reshape(-1)
    order = np.lexsort((labels, -depths[grouped]))  # the longest prefixes first: their programs start first
    members, labels = grouped[order], labels[order]
    starts = np.flatnonzero(np.concatenate([[True], labels[1:] != labels[:-1]]))
    counts = np.diff(np.concatenate([starts, [len(labels)]]))
    rows, kept = [], []
    for start, count in zip(starts[counts > 1].tolist(), counts[counts > 1].tolist(), strict=True):
        shared = int(depths[members[start]]) * block
        parts = -(-count // max_members)
        sizes = np.full(parts, count // parts) + (np.arange(parts) < count % parts)
        first = sum(len(k) for k in kept)
        for offset, size in zip((np.cumsum(sizes) - sizes).tolist(), sizes.tolist(), strict=True):
            rows.append((first + offset, size, shared, int(table_rows[members[start + offset]])))
        kept.append(members[start : start + count])
    if not rows:
        return None
    ordered = np.concatenate(kept).astype(np.int32)
    shared_lens = np.zeros(len(seq_lens), dtype=np.int32)
    shared_lens[ordered] = np.repeat([r[2] for r in rows], [r[1] for r in rows])
    return DecodeGroups(np.asarray(rows, dtype=np.int32).reshape(-1, 4), ordered, shared_lens)
