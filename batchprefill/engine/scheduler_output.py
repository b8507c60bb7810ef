"""What the scheduler hands the model runner for one step: plain data, so the runner imports no scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchprefill.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # query tokens this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's chunks, decodes first, and the requests preempted to make room for them."""

    chunks: list[ScheduledChunk]
    num_decode_tokens: int
    num_prefill_tokens: int
    preempted: list[Request] = field(default_factory=list)  # requests whose blocks were taken back this step
