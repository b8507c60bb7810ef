"""The running requests' scheduling state in numpy columns, kept in step with the scheduler's running list.

A decode step visits every running request: is it decoding, does its next token need a new block. As a Python loop
over the requests that cost 0.43 ms a step at 1,024 sequences (benchmarks/cpu/host_overhead.py --seqs 1024
--stub-forward, AMD EPYC Zen 4); on an H200 a 511-sequence step's schedule was 0.83 ms of 2.1 ms of host work while
the GPU waited. Here each running request has a slot holding its computed tokens, its block count and whether it
decodes, so the pass is a few array operations over the slots in running order.

The request's own fields stay the truth; the columns mirror them at every `Scheduler.schedule`:
- `computed[slot]` is `num_computed_tokens`: set on `add`, advanced by `Scheduler.commit`;
- `blocks[slot]` is `len(block_table)`: set on `add`, grown where the scheduler allocates;
- `decoding[slot]` is `is_decoding`: set on `add`, and by the scheduler once a request will have sampled a token
  (`Scheduler.commit` of a chunk that completes a request that samples, `Scheduler.fork` of a sample); it then
  decodes every step until it leaves the running list: a decode computes one token and samples one.
A request leaves (`remove`) when it finishes or is preempted; its slot returns to the free list at the next
compaction, so a slot is never reused while a step that scheduled its old request may still commit it.
"""

from __future__ import annotations

import numpy as np

from batchprefill.engine.request import Request


class BatchRows:
    def __init__(self, capacity: int):
        self.computed = np.zeros(capacity, dtype=np.int64)
        self.blocks = np.zeros(capacity, dtype=np.int64)
        self.decoding = np.zeros(capacity, dtype=bool)
        self._order = np.zeros(capacity, dtype=np.int64)  # the running requests' slots, oldest first
        self._size = 0
        self._free = list(range(capacity - 1, -1, -1))
        self._removed: list[int] = []  # slots given up since the last compaction
        self.slot_of: dict[int, int] = {}  # id(request) -> slot

    def add(self, request: Request) -> int:
        """A request joins the end of the running list: its slot, filled from its fields."""
        self._compact()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slot_of[id(request)] = slot
        self.computed[slot] = request.num_computed_tokens
        self.blocks[slot] = len(request.block_table)
        self.decoding[slot] = request.is_decoding
        self._order[self._size] = slot
        self._size += 1
        return slot

    def remove(self, request: Request) -> None:
        """A request left the running list (finished or preempted)."""
        self._removed.append(self.slot_of.pop(id(request)))

    def running_slots(self) -> np.ndarray:
        """The running requests' slots in running order (a view: valid until the next `add` or `remove`)."""
        self._compact()
        return self._order[: self._size]

    def set_blocks(self, request: Request) -> None:
        self.blocks[self.slot_of[id(request)]] = len(request.block_table)

    def _compact(self) -> None:
        if not self._removed:
            return
        live = self._order[: self._size]
        kept = live[~np.isin(live, self._removed)]
        self._size = len(kept)
        self._order[: self._size] = kept
        self._free.extend(self._removed)
        self._removed.clear()

    def _grow(self) -> None:
        """Twice the slots (the running list outgrew max_num_seqs: forked children may exceed it briefly)."""
        capacity = len(self.computed)
        for name in ("computed", "blocks", "decoding", "_order"):
            column = getattr(self, name)
            grown = np.zeros(2 * capacity, dtype=column.dtype)
            grown[:capacity] = column
            setattr(self, name, grown)
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))
