"""What the engine is built from: the job's engine settings (the `engine` keys, which settings.py reads into
EngineSettings), and what the job derived from its model and device.

One config travels from the settings to the engine: the settings as they were read, never copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineSettings:
    """The `engine` keys. The defaults are conf/config.yaml's as the CPU resolves them, for engines built without a
    job (tests, benchmarks); a job sets every field from its config. `max_batched_tokens` and `max_num_seqs` may
    be "auto" as read; the job replaces auto by numbers (pipeline/engine_sizes.py) before it builds an engine, so an
    engine only sees ints."""

    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_batched_tokens: int | Literal["auto"] = 2048
    max_num_seqs: int | Literal["auto"] = 256
    kv_cache_tokens: int | None = None
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    cache_namespace: str = "default"
    reserve_output_blocks: bool = True  # admit a request only if its prompt and max_tokens outputs fit
    num_threads: int | None = None
    cuda_graphs: bool = True
    batch_invariant: bool = False  # a row's results are bitwise the same whatever shares its steps


@dataclass(frozen=True)
class EngineConfig:
    settings: EngineSettings
    num_blocks: int  # the KV pool, sized from the model, the device's free memory and what the job needs
    padded_decode: str = "off"  # "graphs" on CUDA: decode-only steps replay captured CUDA graphs
    # On CUDA: while the device runs a step the host schedules and prepares the next, reading a step's tokens only
    # after the next is launched (engine.py: the overlapped loop); tests turn it on to run that loop on the CPU.
    overlap: bool = False
    sizes_summary: str = ""  # what engine.*=auto chose and why, for the run's summary ("" when nothing was auto)
