"""The block pool's reference counts as a numpy column, and the prefix cache's match up to the first miss in C,
choose exactly what the per-block Python loops they replaced chose (hypothesis, no model): the same blocks
allocated, the same LRU order of reclaimable blocks, the same evictions, the same hits."""

import hashlib
from collections import OrderedDict, deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.prefix_cache import PrefixCache, block_key
from batchprefill.engine.request import Request
from batchprefill.sampling_params import SamplingParams


class LoopPool:
    """The pool as it was: a reference count per block in a list, every operation a loop over blocks."""

    def __init__(self, num_blocks: int):
        self.ref_counts = [0] * num_blocks
        self.keys: list[bytes | None] = [None] * num_blocks
        self.free = deque(range(num_blocks))
        self.reclaimable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}
        self.evictions = 0

    def allocate(self, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.reclaimable.popitem(last=False)
                del self.cached[self.keys[block]]
                self.keys[block] = None
                self.evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.reclaimable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.keys[block] is None:
                    self.free.append(block)
                else:
                    self.reclaimable[block] = None

    def register(self, block: int, key: bytes) -> None:
        if self.keys[block] is None and key not in self.cached:
            self.cached[key] = block
            self.keys[block] = key


def same(pool: BlockPool, loop: LoopPool) -> None:
    assert pool.ref_counts.tolist() == loop.ref_counts
    assert list(pool.free) == list(loop.free) and list(pool.reclaimable) == list(loop.reclaimable)
    assert pool.keys == loop.keys and pool.cached == loop.cached and pool.evictions == loop.evictions


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), ops=st.lists(st.tuples(st.sampled_from("aqrg"), st.integers(0, 10**6)),
                                                     max_size=60))
def test_pool_columns_match_the_loops(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Random allocations, prefix hits on cached blocks, releases and registrations, on both pools in step."""
    pool, loop = BlockPool(num_blocks), LoopPool(num_blocks)
    tables: list[list[int]] = []  # what the requests hold
    for op, value in ops:
        if op == "a" and pool.num_available:
            count = 1 + value % pool.num_available
            blocks = pool.allocate(count)
            assert blocks == loop.allocate(count)
            tables.append(blocks)
        elif op == "q" and pool.cached:  # a hit: some distinct cached blocks, in a random order
            cached = sorted(pool.cached.values())
            hits = [cached[(value + 7 * i) % len(cached)] for i in range(1 + value % len(cached))]
            hits = list(dict.fromkeys(hits))
            assert pool.unreferenced(np.array(hits)) == sum(loop.ref_counts[b] == 0 for b in hits)
            pool.acquire(np.array(hits, dtype=np.int64))
            loop.acquire(hits)
            tables.append(hits)
        elif op == "r" and tables:
            table = tables.pop(value % len(tables))
            pool.release(table)
            loop.release(table)
        elif op == "g" and tables:
            table = tables[value % len(tables)]
            block, key = table[value % len(table)], bytes([value % 5])
            pool.register(block, key)
            loop.register(block, key)
        same(pool, loop)


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(0, 12), cached=st.lists(st.booleans(), min_size=12, max_size=12),
       in_flight=st.integers(0, 12))
def test_match_is_the_longest_cached_prefix(num_blocks: int, cached: list[bool], in_flight: int) -> None:
    """Hits are the blocks of the leading cached keys, stopping at the first uncached one (even when later keys are
    cached), and the wait is whether that first uncached key is in flight."""
    size = 4
    pool = BlockPool(16)
    cache = PrefixCache(pool, size, ("m",), enabled=True)
    request = Request(0, list(range(num_blocks * size + 1)), SamplingParams(max_tokens=1))
    keys = cache.keys(request, num_blocks)
    for index, key in enumerate(keys):
        if cached[index]:
            pool.register(index, key)
    if in_flight < num_blocks:
        cache.in_flight[keys[in_flight]] = request
    hits, waits = cache.match(request)
    expected = []
    for key in keys:
        if key not in pool.cached:
            break
        expected.append(pool.cached[key])
    assert hits.tolist() == expected
    assert waits == (len(expected) < num_blocks and len(expected) == in_flight)


@given(parent=st.binary(min_size=16, max_size=16), tokens=st.lists(st.integers(0, 2**31 - 1), max_size=32))
def test_block_key_hashes_the_tokens_as_int64(parent: bytes, tokens: list[int]) -> None:
    """The key is the one numpy's int64 bytes gave: keys are the same whichever way the bytes are made."""
    expected = hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()
    assert block_key(parent, tokens) == expected
