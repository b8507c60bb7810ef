"""Decode-first scheduling under a per-step token budget, with prefix reuse and fill-once-per-group.

Each step: every running decode takes one token of `max_batched_tokens` first; what remains goes to
prefill chunks, first of requests already part-way through their prompt, then of waiting ones. A
waiting request whose next uncached block is being computed by another request right now is held
back until that block is cached, so a prefix shared by a whole group is computed once. When the pool
cannot hold a step's KV, the newest running request is preempted and recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from batchprefill.engine.block_pool import BlockPool, block_key
from batchprefill.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # query tokens this step, from request.num_computed_tokens on


@dataclass
class Step:
    chunks: list[ScheduledChunk]
    num_decode_tokens: int
    num_prefill_tokens: int


class Scheduler:
    def __init__(
        self, pool: BlockPool, block_size: int, max_batched_tokens: int, max_num_seqs: int,
        prefix_caching: bool = True, root_keys: dict[str, bytes] | None = None, reserve_growth: bool = True,
    ):
        self.pool = pool
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.reserve_growth = reserve_growth
        self.root_keys = root_keys if root_keys is not None else {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.in_flight: dict[bytes, Request] = {}  # keys of blocks some request is computing right now
        self.preemptions = 0

    # ---- bookkeeping --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block keys for its first `num_blocks` full blocks."""
        keys, size = request.block_hashes, self.block_size
        parent = keys[-1] if keys else self.root_keys[request.namespace]
        while len(keys) < num_blocks:
            start = len(keys) * size
            parent = block_key(parent, request.tokens(start, start + size))
            keys.append(parent)
        return keys[:num_blocks]

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_table))

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> Step:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()

        for request in list(self.running):  # decodes first, oldest first
            if not request.is_decoding or request.status is not Status.RUNNING:
                continue
            if budget == 0 or len(chunks) >= self.max_num_seqs:
                break
            if not self._reserve(request, 1, scheduled):
                continue  # it was preempted itself
            chunks.append(ScheduledChunk(request, 1))
            scheduled.add(id(request))
            budget -= 1
        num_decode = len(chunks)

        for request in self.running:  # then prompts already part-way through
            if budget == 0:
                break
            if request.is_decoding or id(request) in scheduled:
                continue
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            count = min(count, self._fits(request))
            if count <= 0:
                break
            self._reserve(request, count, scheduled)
            chunks.append(ScheduledChunk(request, count))
            scheduled.add(id(request))
            budget -= count

        budget = self._admit(budget, chunks)
        return Step(chunks, num_decode, self.max_batched_tokens - budget - num_decode)

    def _fits(self, request: Request) -> int:
        """How many more tokens of this request the pool can hold without preempting anyone."""
        slack = len(request.block_table) * self.block_size - request.num_computed_tokens
        return slack + self.pool.num_available * self.block_size

    def _reserve(self, request: Request, count: int, scheduled: set[int]) -> bool:
        """Make room for `count` more tokens of a running request, preempting the newest others if needed."""
        need = self._blocks_needed(request, request.num_computed_tokens + count)
        while need > self.pool.num_available:
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled and r is not request), None)
            self._preempt(victim or request)
            if victim is None:
                return False
        request.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _release(self, request: Request) -> None:
        for key in request.block_hashes:
            if self.in_flight.get(key) is request:
                del self.in_flight[key]
        self.pool.release(request.block_table)
        request.block_table = []

    def _growth(self, request: Request) -> int:
        """Blocks a request may still claim: up to its whole prompt plus max_tokens outputs."""
        final = request.num_prompt_tokens + request.sampling.max_tokens
        return max(0, -(-final // self.block_size) - len(request.block_table))

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admit waiting requests in order while budget, sequence slots and blocks last.

        With `reserve_growth`, a request is admitted only if the pool also holds every running request's
        remaining growth and its own: a batch job knows each request's ceiling, so it need not preempt and
        recompute. Without it, admission looks at this step only and preemption resolves overcommitment.
        """
        held_back: list[Request] = []
        reserved = sum(self._growth(r) for r in self.running) if self.reserve_growth else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            hits, next_key = self._match(request)
            if next_key is not None and next_key in self.in_flight:
                held_back.append(request)  # its prefix is being filled by another request: wait for it
                continue
            cached = len(hits) * self.block_size
            count = min(request.num_tokens - cached, budget)
            need = -(-(cached + count) // self.block_size) - len(hits)
            claim = need
            if self.reserve_growth:
                total = request.num_prompt_tokens + request.sampling.max_tokens
                claim = max(need, -(-total // self.block_size) - len(hits)) + reserved
            if claim > self.pool.num_available - sum(self.pool.ref_counts[b] == 0 for b in hits):
                self.waiting.appendleft(request)
                break
            self.pool.acquire(hits)
            request.block_table = hits + self.pool.allocate(need)
            if self.reserve_growth:
                reserved = claim - need
            request.num_computed_tokens = cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
            self._claim_in_flight(request, len(hits))
            request.status = Status.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, count))
            budget -= count
        self.waiting.extendleft(reversed(held_back))
        return budget

    def _match(self, request: Request) -> tuple[list[int], bytes | None]:
        """Cached blocks of the request's longest cached prefix, and the key of the first block it must compute.

        At least one token is always left to compute: its logits give the first output token.
        """
        if not self.prefix_caching:
            return [], None
        matchable = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in self._keys(request, matchable):
            block = self.pool.lookup(key)
            if block is None:
                return hits, key
            hits.append(block)
        return hits, None

    def _claim_in_flight(self, request: Request, first: int) -> None:
        """Announce the full prompt blocks this request will compute, so its group waits for them."""
        if not self.prefix_caching:
            return
        full = request.num_tokens // self.block_size
        for key in self._keys(request, full)[first:]:
            if key not in self.in_flight and self.pool.lookup(key) is None:
                self.in_flight[key] = request

    # ---- after the forward pass -----------------------------------------------------------------
    def commit(self, step: Step) -> None:
        """Advance computed counts and cache every block that is now full."""
        for chunk in step.chunks:
            request = chunk.request
            before = request.num_computed_tokens // self.block_size
            request.num_computed_tokens += chunk.num_tokens
            if not self.prefix_caching:
                continue
            full = request.num_computed_tokens // self.block_size
            for index, key in enumerate(self._keys(request, full)[before:], start=before):
                self.pool.register(request.block_table[index], key)
                if self.in_flight.get(key) is request:
                    del self.in_flight[key]

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = Status.FINISHED
