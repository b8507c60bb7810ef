"""What an engine counts while it runs, as plain data: running totals, and one row per step (stats/steps.parquet).

The job's statistics (report/stats.py) and the run figure read these, and need no engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """One step's row of stats/steps.parquet."""

    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    active_blocks: int
    reclaimable_blocks: int
    free_blocks: int
    duration_ms: float
    # Where the step's time went, on the host's clock. On a GPU the forward only launches: in the synchronous loop
    # its device time shows up in sample_ms, which waits for the tokens. In the overlapped loop (engine.py, on
    # CUDA) nothing of this step waits for the device: the step's row is its iteration, whose wait and bookkeeping
    # are those of the previous step's tokens, read after this step was launched; duration_ms is then the time
    # from one launch to the next.
    schedule_ms: float
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    bookkeeping_ms: float  # appending tokens, stop checks, finishing requests, this record
    token_wait_ms: float  # the host blocked on the device for the overlapped loop's previous step's tokens
    # Running totals since the engine started: the run figure draws eviction and preemption marks and the running
    # cache hit rate (finished cached over finished prompt tokens, which ends at the job's cache_hit_rate) from them.
    evicted_blocks: int
    preemptions: int
    finished_prompt_tokens: int
    finished_cached_tokens: int


@dataclass
class EngineCounters:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished_prompt_tokens: int = 0
    finished_cached_tokens: int = 0
    steps: list[StepStats] = field(default_factory=list)

    # Blocks are evicted and requests preempted only inside a step, so the last step's running totals are the
    # engine's: no step stores them twice.
    @property
    def evicted_blocks(self) -> int:
        return self.steps[-1].evicted_blocks if self.steps else 0

    @property
    def preemptions(self) -> int:
        return self.steps[-1].preemptions if self.steps else 0
