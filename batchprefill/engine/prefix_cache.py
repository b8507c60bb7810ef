"""The prefix cache's keys, kept beside the scheduler as vLLM v1 keeps them in its KV-cache manager.

A full block's key hashes its parent's key with its own tokens, so a changed token changes every later key; a
chain starts from a root key holding everything else that changes KV for the same tokens (the model's scope,
the cache namespace, the tenant's namespace). Keys are grown lazily, per request, as far as a step needs them.

The scheduler asks three things of it: which leading blocks of a waiting request are cached (and whether the
first block it must compute is being computed by another request right now: then the request waits, so a
prefix shared by a group is computed once), to announce the blocks an admitted request will compute, and to
register blocks as they fill. With prefix caching off all three are chosen at construction to do nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import partial
from itertools import takewhile
from operator import is_not

import numpy as np

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.request import Request

NO_BLOCKS = np.zeros(0, dtype=np.int64)
_is_block = partial(is_not, None)  # a cache lookup that found a block, tested in C


def scope_key(*parts: object) -> bytes:
    """The root of every hash chain: everything that changes KV for the same tokens."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's key: its parent's key and its own tokens (as 64-bit integers), so a changed token changes
    every later key. The bytes through `array` rather than numpy: 1.2 us a block of 16 against 1.8 us."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Block keys over one pool: `scope` is the model's cache scope with the cache namespace."""

    def __init__(self, pool: BlockPool, block_size: int, scope: tuple, enabled: bool):
        self.pool = pool
        self.block_size = block_size
        self.scope = scope
        self.root_keys: dict[str, bytes] = {}  # namespace -> the root of its hash chains
        self.in_flight: dict[bytes, Request] = {}  # keys of blocks some request is computing right now
        self.announced: dict[int, list[bytes]] = {}  # id(request) -> the keys it put in flight
        # Chosen once here, so the per-step path never asks whether prefix caching is on.
        self.match = self._cached_prefix if enabled else self._no_prefix
        self.announce = self._announce_blocks if enabled else self._announce_nothing
        self.register = self._register_blocks if enabled else self._register_nothing

    def keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block keys, grown to at least its first `num_blocks` full blocks (the list
        itself, not a copy: callers index the span they need)."""
        keys, size = request.block_hashes, self.block_size
        donor = request.prefix_donor
        if donor is not None:  # the order stage found its leading blocks equal to its neighbour's: no rehashing
            request.prefix_donor = None
            if not keys:
                keys.extend(donor.block_hashes[: request.donor_blocks])
        parent = keys[-1] if keys else self._root_key(request.namespace)
        while len(keys) < num_blocks:
            start = len(keys) * size
            parent = block_key(parent, request.tokens(start, start + size))
            keys.append(parent)
        return keys

    def _root_key(self, namespace: str) -> bytes:
        """Everything that changes KV for the same tokens: the model's scope, the cache namespace, the tenant."""
        key = self.root_keys.get(namespace)
        if key is None:
            key = self.root_keys[namespace] = scope_key(*self.scope, namespace)
        return key

    def _cached_prefix(self, request: Request) -> tuple[np.ndarray, bool]:
        """Cached blocks of the request's longest cached prefix, and whether the first block it must compute is
        in flight (another request computes it now).

        At least one token is always left to compute: its logits give the first output token. A request that
        does not reuse a prefix (`reuse_prefix`) finds none and waits for none. The keys are looked up up to the
        first miss in C, straight into an array: a lookup per key in a Python loop cost 10 us for a prompt of 94
        full blocks (benchmarks/cpu/host_overhead.py), 5.3 us so.
        """
        if not request.reuse_prefix:
            return NO_BLOCKS, False
        matchable = (request.num_tokens - 1) // self.block_size
        keys, lookup = self.keys(request, matchable), self.pool.cached.get
        if not matchable or lookup(keys[0]) is None:  # nothing cached (a group's first block still in flight)
            return NO_BLOCKS, matchable > 0 and keys[0] in self.in_flight
        hits = np.fromiter(takewhile(_is_block, map(lookup, keys[:matchable])), np.int64)
        return hits, len(hits) < matchable and keys[len(hits)] in self.in_flight

    @staticmethod
    def _no_prefix(request: Request) -> tuple[np.ndarray, bool]:
        return NO_BLOCKS, False

    def _announce_blocks(self, request: Request, first: int) -> None:
        """Announce the full prompt blocks this request will compute, from block `first` on, so its group waits
        for them."""
        full = request.num_tokens // self.block_size
        announced = [key for key in self.keys(request, full)[first:full]
                     if key not in self.in_flight and self.pool.lookup(key) is None]
        if announced:
            self.in_flight.update(dict.fromkeys(announced, request))
            self.announced[id(request)] = announced

    @staticmethod
    def _announce_nothing(request: Request, first: int) -> None:
        pass

    def _register_blocks(self, request: Request, before: int) -> None:
        """Cache every block from `before` on that the request has now fully computed."""
        full = request.num_computed_tokens // self.block_size
        keys = self.keys(request, full)
        for index in range(before, full):
            key = keys[index]
            self.pool.register(request.block_table[index], key)
            if self.in_flight.get(key) is request:
                del self.in_flight[key]

    @staticmethod
    def _register_nothing(request: Request, before: int) -> None:
        pass

    def release(self, request: Request) -> None:
        """A request that gives its blocks back no longer computes the blocks it announced (looking at those alone,
        not at all its keys, saved 5 us a finished request of 95 blocks)."""
        for key in self.announced.pop(id(request), ()):
            if self.in_flight.get(key) is request:
                del self.in_flight[key]

    @staticmethod
    def inherit(child: Request, parent: Request, num_blocks: int) -> None:
        """A forked child's keys: its parent's, for the `num_blocks` full blocks they share (none hashed again)."""
        child.block_hashes = parent.block_hashes[:num_blocks]
