"""A fixed pool of KV blocks in three disjoint buckets, and the prefix cache that maps keys to blocks (the keys
are `prefix_cache.py`'s).

- active: reference count > 0, in some request's block table;
- reclaimable: reference count 0 but holding a cached prefix, kept in LRU order for reuse or eviction;
- free: holding nothing valid.

Eviction only unlinks a block's key; the memory behind it is never freed.

Reference counts are a numpy column, so a prefix hit's blocks are counted and acquired, and a request's blocks
released, in a few array operations rather than a Python loop per block: admitting a request that reuses 93
cached blocks (benchmarks/cpu/host_overhead.py's prompts) cost 6.3 us to acquire them one by one and 4.3 us more
to count the reclaimable ones, against about 3 us for both on the column. Releasing costs the same either way
(6 us for 95 blocks), but a loop over a numpy column would be slower than over a list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PoolExhausted(RuntimeError):
    pass


@dataclass
class BucketCounts:
    active: int
    reclaimable: int
    free: int


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.keys: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.reclaimable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.cached: dict[bytes, int] = {}
        self.evictions = 0

    def counts(self) -> BucketCounts:
        spare = len(self.free) + len(self.reclaimable)
        return BucketCounts(self.num_blocks - spare, len(self.reclaimable), len(self.free))

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.reclaimable)

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def allocate(self, count: int) -> list[int]:
        """Blocks with no valid data: free ones first, then the least recently used reclaimable ones."""
        if count > self.num_available:
            raise PoolExhausted(f"{count} blocks asked, {self.num_available} available")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.reclaimable.popitem(last=False)
                del self.cached[self.keys[block]]
                self.keys[block] = None
                self.evictions += 1
            self.ref_counts[block] = 1  # one by one: an admission takes 1-3 blocks, where an array call costs more
            blocks.append(block)
        return blocks

    def unreferenced(self, blocks: np.ndarray) -> int:
        """How many of these (distinct) blocks no request holds: the reclaimable ones a prefix hit would take."""
        return int(np.count_nonzero(self.ref_counts[blocks] == 0))

    def acquire(self, blocks: np.ndarray) -> None:
        """Take a reference on cached (distinct) blocks: a prefix hit."""
        refs = self.ref_counts[blocks]
        for block in blocks[refs == 0].tolist():
            del self.reclaimable[block]
        self.ref_counts[blocks] = refs + 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a request's references, deepest block first, so deep blocks are evicted before shallow ones."""
        deepest_first = np.fromiter(reversed(blocks), np.int64, len(blocks))
        refs = self.ref_counts[deepest_first] - 1
        self.ref_counts[deepest_first] = refs
        for block in deepest_first[refs == 0].tolist():
            if self.keys[block] is None:
                self.free.append(block)
            else:
                self.reclaimable[block] = None

    def register(self, block: int, key: bytes) -> None:
        """Mark a block whose KV is now fully computed as the holder of `key`, unless another already is."""
        if self.keys[block] is None and key not in self.cached:
            self.cached[key] = block
            self.keys[block] = key

    def fork(self, table: Sequence[int], num_tokens: int, block_size: int) -> tuple[list[int], tuple[int, int] | None]:
        """A child's block table for the first `num_tokens` tokens of a parent's `table`, and the (parent, child)
        block pair whose KV the runner must copy: the child shares every full block (a reference each) and gets a
        private block for the partial last one (copy-on-write), since its own tokens go there next. One block
        must be available when `num_tokens` is not a multiple of `block_size`."""
        shared = list(table[: num_tokens // block_size])
        self.acquire(np.array(shared, dtype=np.int64))
        if num_tokens % block_size == 0:
            return shared, None
        private = self.allocate(1)[0]
        return [*shared, private], (table[len(shared)], private)
