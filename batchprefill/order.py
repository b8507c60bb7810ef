"""Order prompts so that shared prefixes sit together, group them, and split partitions over shards.

Sorting token sequences lexicographically lays a dataset out in the depth-first order of its prefix
trie: every set of prompts sharing a prefix becomes one contiguous run, at every depth. In that order a
prompt's longest shared prefix with any earlier prompt is its shared prefix with the one just before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Group:
    """A maximal run of prompts (in run order) that share at least their first full KV block."""

    start: int
    stop: int
    shared_prefix_tokens: int  # full-block prefix common to every member


def prefix_order(token_ids: list[list[int]], namespaces: list[str]) -> list[int]:
    """Row positions sorted by namespace, then token ids: the depth-first order of the prefix trie."""
    return sorted(range(len(token_ids)), key=lambda i: (namespaces[i], token_ids[i]))


def shared_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """How many leading full blocks two token sequences have in common."""
    limit = min(len(a), len(b)) // block_size
    blocks = 0
    while blocks < limit and a[blocks * block_size : (blocks + 1) * block_size] == b[
        blocks * block_size : (blocks + 1) * block_size
    ]:
        blocks += 1
    return blocks


def reusable_tokens(token_ids: list[list[int]], namespaces: list[str], block_size: int) -> list[int]:
    """Per prompt in run order: prompt tokens an ideal cache serves, with one token always left to compute."""
    reuse = []
    for i, ids in enumerate(token_ids):
        if i == 0 or namespaces[i] != namespaces[i - 1]:
            reuse.append(0)
            continue
        blocks = min(shared_blocks(token_ids[i - 1], ids, block_size), (len(ids) - 1) // block_size)
        reuse.append(blocks * block_size)
    return reuse


def groups(token_ids: list[list[int]], namespaces: list[str], block_size: int) -> list[Group]:
    """Split a run order into groups: consecutive prompts that share their first full block."""
    result: list[Group] = []
    for i, ids in enumerate(token_ids):
        joins = (
            result
            and namespaces[i] == namespaces[i - 1]
            and result[-1].shared_prefix_tokens > 0
            and shared_blocks(token_ids[result[-1].start], ids, block_size) > 0
        )
        if joins:
            group = result[-1]
            shared = shared_blocks(token_ids[group.start], ids, block_size) * block_size
            group.shared_prefix_tokens = min(group.shared_prefix_tokens, shared)
            group.stop = i + 1
        else:
            result.append(Group(i, i + 1, (len(ids) // block_size) * block_size))
    for group in result:
        if group.stop - group.start == 1:
            group.shared_prefix_tokens = 0  # a group of one shares nothing
    return result


def assign_shards(partition_tokens: list[int], num_shards: int) -> list[list[int]]:
    """Whole partitions per shard, balanced by prompt tokens (largest first onto the lightest shard)."""
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for part in sorted(range(len(partition_tokens)), key=lambda p: (-partition_tokens[p], p)):
        lightest = min(range(num_shards), key=lambda s: (loads[s], s))
        shards[lightest].append(part)
        loads[lightest] += partition_tokens[part]
    return [sorted(s) for s in shards]
