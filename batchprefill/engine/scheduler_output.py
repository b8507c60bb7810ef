"""What the scheduler hands the model runner for one step: plain data, so the runner imports no scheduler.

A step is columns, one entry per scheduled chunk, decodes first (vLLM v1's sched/output.py keeps per-request
arrays too): at 1,024 decodes a step, building one ScheduledChunk object each was a tenth of the scheduler's time,
and the runner reads the columns with numpy. `chunks` makes the objects for callers that want them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchprefill.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # query tokens this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's chunks as columns, decodes first, and the requests preempted to make room for them."""

    requests: list[Request]
    num_tokens: np.ndarray  # [C] int64: each chunk's query tokens, from its request's num_computed_tokens on
    starts: np.ndarray  # [C] int64: each request's num_computed_tokens when scheduled
    num_blocks: np.ndarray  # [C] int64: the length of each request's block table, this step's blocks included
    slots: np.ndarray  # [C] int64: each request's slot in the scheduler's BatchRows
    num_decode_tokens: int  # the first num_decode_tokens chunks are decodes: one token each, after the last sampled
    num_prefill_tokens: int
    preempted: list[Request] = field(default_factory=list)  # requests whose blocks were taken back this step

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return [ScheduledChunk(request, count) for request, count in zip(self.requests, self.num_tokens.tolist())]
