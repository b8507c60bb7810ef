"""Where a job's time goes before its first engine step: preparing the input, loading the model, warming up.

On an H200 the 1B shared-prefix job (benchmarks/gpu/gpu_job.py) spent 8.3 s inside the job, of which the engine loop
was 3.1 s: these three figures, in stats/job.parquet and the run's summary, say where the other 5.2 s went.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchprefill.engine.model_runner import WARM_UP_PHASES, say_nothing

STARTUP_COLUMNS = ("prepare_seconds", "load_seconds", "warm_up_seconds")


class StartupClock:
    """Told each start-up phase as the progress bar is (it is an engine build's `on_phase`, and passes each phase on
    to the bar): it keeps when the job began, when the engine's build began, when each phase began and when the
    engine was ready."""

    def __init__(self):
        self.tell: Callable[[str], None] = say_nothing
        self.began = self.build_began = self.ready = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def __call__(self, phase: str) -> None:
        self.phases.append((phase, time.perf_counter()))
        self.tell(phase)

    def building(self, tell: Callable[[str], None]) -> None:
        """The input is prepared: the engine's build (the model's load, the KV pool, warm-up) begins now, and its
        phases go on to `tell` as they come."""
        self.tell = tell
        self.build_began = time.perf_counter()

    def engine_ready(self) -> None:
        self.ready = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        """`prepare_seconds`: from the job's start to the engine's build (tokenizing, partitioning, the resume check,
        compiling the job's grammar); `warm_up_seconds`: compiling kernels and capturing graphs (a GPU's; 0 on a
        CPU); `load_seconds`: the rest of the build (the weights, adapters and KV pool onto the device)."""
        ends = [began for _, began in self.phases[1:]] + [self.ready]
        warm_up = sum(end - began for (phase, began), end in zip(self.phases, ends) if phase in WARM_UP_PHASES)
        return {"prepare_seconds": self.build_began - self.began,
                "load_seconds": self.ready - self.build_began - warm_up, "warm_up_seconds": warm_up}
