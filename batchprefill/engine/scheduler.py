"""Decode-first scheduling under a per-step token budget, with prefix reuse and fill-once-per-group.

Each step: every running decode takes one token of `max_batched_tokens` first; what remains goes to
prefill chunks, first of requests already part-way through their prompt, then of waiting ones. A
waiting request whose next uncached block is being computed by another request right now is held
back until that block is cached, so a prefix shared by a whole group is computed once (the block keys
that tell are `prefix_cache.py`'s). When the pool cannot hold a step's KV, the newest running request
is preempted and recomputed later.

A request may carry children to fork once its prompt is computed (n samples, the choices of a score): each
child shares the parent's full blocks and gets a copy of its partial one, so the prompt is computed once. A
parent is admitted only with sequence slots (and, with `reserve_growth`, blocks) for its children too; a
child that finds no slot or block at fork time waits instead, and recomputes only what the cache lost.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from batchprefill.engine.batch_rows import BatchRows
from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineSettings
from batchprefill.engine.prefix_cache import PrefixCache
from batchprefill.engine.request import Request, Status
from batchprefill.engine.scheduler_output import SchedulerOutput
from batchprefill.intmath import cdiv


class Scheduler:
    """Built from the engine settings and the model's cache scope; the policies it was built with are fixed."""

    def __init__(self, pool: BlockPool, settings: EngineSettings, model_scope: tuple):
        self.pool = pool
        self.block_size = settings.block_size
        self.max_batched_tokens = settings.max_batched_tokens
        self.max_num_seqs = settings.max_num_seqs
        self.reserve_growth = settings.reserve_output_blocks
        self.prefix_cache = PrefixCache(pool, settings.block_size, (*model_scope, settings.cache_namespace),
                                        settings.prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.rows = BatchRows(settings.max_num_seqs)  # their state in columns, for the decode pass
        self.preemptions = 0
        self.fork_slots = 0  # sequence slots held for the children of running requests, forked later
        self._preempted: list[Request] = []  # this step's, handed out with it
        # Sums over the running requests, kept as they change so admission need not visit every running
        # request each step: their final block counts (prompt + max_tokens) and the blocks they hold.
        self._final_blocks = 0
        self._held_blocks = 0
        self._pending_fork_blocks = 0  # what the children not yet forked will claim beyond the blocks they share

    # ---- bookkeeping --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_table))

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        requests, decode_slots = self._decodes(min(budget, self.max_num_seqs))
        num_decode = len(requests)
        budget -= num_decode
        counts: list[int] = []  # the prompt chunks' tokens

        if num_decode < len(self.running):  # a pure decode step skips this
            scheduled = set(map(id, requests))
            for request in list(self.running):  # then prompts already part-way through
                if budget == 0:
                    break
                if request.is_decoding or id(request) in scheduled or request.status is not Status.RUNNING:
                    continue
                count = min(request.num_tokens - request.num_computed_tokens, budget, self._room_for(request))
                if count <= 0 and not requests:
                    # Nothing else runs and the pool is full (forked children can fill it between steps): free
                    # room by preempting the newest other request, else no step would ever run again.
                    victim = next((r for r in reversed(self.running) if r is not request), None)
                    if victim is not None:
                        self._preempt(victim)
                        count = min(request.num_tokens - request.num_computed_tokens, budget,
                                    self._room_for(request))
                if count <= 0:
                    break
                self._reserve(request, count, scheduled)
                requests.append(request)
                counts.append(count)
                scheduled.add(id(request))
                budget -= count

        budget = self._admit(budget, requests, counts)
        preempted, self._preempted = self._preempted, []
        rows = self.rows
        slots = np.concatenate((decode_slots, self._slots(requests[num_decode:])))
        num_tokens = np.concatenate((np.ones(num_decode, dtype=np.int64), np.array(counts, dtype=np.int64)))
        return SchedulerOutput(requests, num_tokens, rows.computed[slots], rows.blocks[slots], slots, num_decode,
                               self.max_batched_tokens - budget - num_decode, preempted)

    def _slots(self, requests: list[Request]) -> np.ndarray:
        return np.fromiter(map(self.rows.slot_of.__getitem__, map(id, requests)), np.int64, len(requests))

    def _decodes(self, most: int) -> tuple[list[Request], np.ndarray]:
        """The running decodes this step takes, oldest first, at most `most`, each with room for its token, and their
        slots. On the columns: when the pool has a block for every decode that needs one, no one is
        preempted, so only those decodes are visited, to take their block (a step of 1,024 decodes: 0.43 ms of
        Python before). Else the per-request loop, whose preemptions (the newest first, possibly the decode itself)
        change who runs as it goes."""
        rows, running = self.rows, self.running
        slots = rows.running_slots()
        positions = np.flatnonzero(rows.decoding[slots])[:most]
        taken = slots[positions]
        size = self.block_size
        need = np.maximum((rows.computed[taken] + size) // size - rows.blocks[taken], 0)
        total = int(need.sum())
        if total > self.pool.num_available:
            return self._decodes_one_by_one(most)
        if total:  # one allocation for them all, handed out in order: the blocks each would have taken in turn
            blocks, start = self.pool.allocate(total), 0
            for index, count in zip(np.flatnonzero(need).tolist(), need[need > 0].tolist()):
                running[positions[index]].block_table.extend(blocks[start : start + count])
                start += count
            rows.blocks[taken] += need
            self._held_blocks += total
        if len(positions) == len(running):
            return list(running), taken
        return [running[p] for p in positions.tolist()], taken

    def _decodes_one_by_one(self, most: int) -> tuple[list[Request], np.ndarray]:
        """`_decodes` when the pool may run short: each decode in turn takes its block, preempting the newest others
        (or itself) when none is left."""
        requests: list[Request] = []
        scheduled: set[int] = set()
        room, running = self.block_size, Status.RUNNING
        for request in list(self.running):  # decodes first, oldest first
            # `request.is_decoding`, inlined: its two property calls were a third of a decode step's schedule
            # (1,000 decodes: 3.1 ms a step on a loaded 2-core machine)
            outputs = request.output_token_ids
            if (request.status is not running or not outputs
                    or request.num_computed_tokens != len(request.prompt_token_ids) + len(outputs) - 1):
                continue
            if len(requests) >= most:
                break
            if request.num_computed_tokens >= len(request.block_table) * room and not self._reserve(
                    request, 1, scheduled):
                continue  # it needed a block and was preempted itself
            requests.append(request)
            scheduled.add(id(request))
        return requests, self._slots(requests)

    def _room_for(self, request: Request) -> int:
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
        self.rows.set_blocks(request)
        self._held_blocks += need
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.rows.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.preemptions += 1
        self._preempted.append(request)

    def _release(self, request: Request) -> None:
        self.prefix_cache.release(request)
        self.pool.release(request.block_table)
        self._held_blocks -= len(request.block_table)
        self._final_blocks -= self._final(request)
        self.fork_slots -= len(request.forks)  # children not forked yet: their slots and growth are no longer held
        self._pending_fork_blocks -= self._fork_growth(request)
        request.block_table = []

    def _final(self, request: Request) -> int:
        """Blocks a request holds at most: its whole prompt plus max_tokens outputs."""
        return cdiv(request.num_prompt_tokens + request.sampling.max_tokens, self.block_size)

    def _fork_growth(self, request: Request) -> int:
        """Blocks the children of a request will claim beyond the full blocks they share with it."""
        shared = request.num_prompt_tokens // self.block_size
        return sum(self._final(c) - shared for c in request.forks)

    def _reserved(self) -> int:
        """Blocks the running requests may still claim, their children's included."""
        return self._final_blocks - self._held_blocks + self._pending_fork_blocks

    def _admit(self, budget: int, requests: list[Request], counts: list[int]) -> int:
        """Admit waiting requests in order while budget, sequence slots and blocks last.

        With `reserve_growth`, a request is admitted only if the pool also holds every running request's
        remaining growth and its own: a batch job knows each request's ceiling, so it need not preempt and
        recompute. Without it, admission looks at this step only and preemption resolves overcommitment.
        """
        held_back: list[Request] = []
        cache = self.prefix_cache
        reserved = self._reserved() if self.reserve_growth else 0
        while self.waiting and budget > 0 and len(self.running) + self.fork_slots < self.max_num_seqs:
            request = self.waiting.popleft()
            if request.pending_sample >= 0:  # preempted with its last token still on the device: it waits for it
                self.waiting.appendleft(request)
                break
            if self.running and len(self.running) + self.fork_slots + 1 + len(request.forks) > self.max_num_seqs:
                self.waiting.appendleft(request)  # no slots for its children yet; alone, they wait instead
                break
            hits, in_flight = cache.match(request)
            if in_flight:
                held_back.append(request)  # its prefix is being filled by another request: wait for it
                continue
            cached = len(hits) * self.block_size
            count = min(request.num_tokens - cached, budget)
            need = cdiv(cached + count, self.block_size) - len(hits)
            claim = need
            if self.reserve_growth:
                # Children's growth is held too, unless nothing runs: then it might exceed the pool, and children
                # that find no room at fork time wait instead (see `fork`).
                children = self._fork_growth(request) if self.running else 0
                claim = max(need, self._final(request) - len(hits)) + children + reserved
            if claim > self.pool.num_available - self.pool.unreferenced(hits):
                self.waiting.appendleft(request)
                break
            self.pool.acquire(hits)
            request.block_table = hits.tolist() + self.pool.allocate(need)
            self._held_blocks += len(request.block_table)
            self._final_blocks += self._final(request)
            if self.reserve_growth:
                reserved = claim - need
            request.num_computed_tokens = cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
            cache.announce(request, len(hits))
            request.status = Status.RUNNING
            self.running.append(request)
            self.rows.add(request)
            self.fork_slots += len(request.forks)
            self._pending_fork_blocks += self._fork_growth(request)
            requests.append(request)
            counts.append(count)
            budget -= count
        self.waiting.extendleft(reversed(held_back))
        return budget

    # ---- after the forward pass -----------------------------------------------------------------
    def commit(self, step: SchedulerOutput) -> None:
        """Advance computed counts and cache every block that is now full. A request that finished while the step
        ran (the overlapped loop learns of an end a step late) has given its blocks back: its chunk is dropped (its
        slot's column too is advanced, harmlessly: a slot is not reused before the next step is scheduled).

        A chunk that completes a request that samples (max_tokens > 0) makes it a decode: the caller appends its
        sampled token (or finishes it) before the next `schedule`, as the engine does; so does a chunk that leaves
        only the last token of a request with outputs (a preempted one, recomputed)."""
        size, register, finished = self.block_size, self.prefix_cache.register, Status.FINISHED
        requests, starts, counts = step.requests, step.starts, step.num_tokens
        after = starts + counts
        self.rows.computed[step.slots] = after
        for request, count in zip(requests, counts.tolist()):
            if request.status is not finished:
                request.num_computed_tokens += count
        for index in np.flatnonzero(after // size > starts // size).tolist():
            request = requests[index]
            if request.status is not finished:
                register(request, int(starts[index]) // size)
        # The decodes decode still. A prompt chunk's request decodes once its prompt is computed if it samples, or
        # (a recomputed one with outputs) once only its last token is left. A finished request's slot is written
        # harmlessly, as above.
        prompts = step.num_decode_tokens
        self.rows.decoding[step.slots[prompts:]] = [
            (r.num_computed_tokens == r.num_tokens - 1 and bool(r.output_token_ids))
            or (r.num_computed_tokens == r.num_tokens and r.sampling.max_tokens > 0) for r in requests[prompts:]]

    def fork(self, parent: Request) -> list[tuple[int, int]]:
        """Start the children of a parent whose prompt is now computed; returns the (parent, child) blocks whose
        KV the runner copies before the next forward pass.

        A child skips admission: it holds the parent's prompt as computed and cached (its own tokens are all that
        is left to compute). Without a free sequence slot or block it waits, to be admitted like any request.
        """
        self._pending_fork_blocks -= self._fork_growth(parent)
        children, parent.forks = parent.forks, []
        self.fork_slots -= len(children)
        copies = []
        computed = parent.num_prompt_tokens
        shared = computed // self.block_size
        # With reserved growth a child forks only if its own growth fits beside every running request's.
        spare = self.pool.num_available - (self._reserved() if self.reserve_growth else 0)
        for child in children:
            growth = self._final(child) - shared
            needs = growth if self.reserve_growth else int(computed % self.block_size != 0)
            if len(self.running) >= self.max_num_seqs or spare < needs:
                self.waiting.appendleft(child)
                continue
            spare -= needs
            child.block_table, copy = self.pool.fork(parent.block_table, computed, self.block_size)
            if copy is not None:
                copies.append(copy)
            self.prefix_cache.inherit(child, parent, shared)
            child.num_computed_tokens = computed
            child.num_cached_tokens = min(computed, child.num_prompt_tokens)
            child.status = Status.RUNNING
            self.running.append(child)
            # A sample draws its first token from the parent's logits before the next step: then it decodes.
            self.rows.decoding[self.rows.add(child)] = child.sampling.max_tokens > 0
            self._held_blocks += len(child.block_table)
            self._final_blocks += self._final(child)
        return copies

    def finish(self, request: Request) -> None:
        """A request is done: a running one gives its blocks back; a waiting one (a child that finished on the
        token its parent's logits gave it) leaves the queue."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.rows.remove(request)
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
