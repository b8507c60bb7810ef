"""What the engine is built from: the job's engine settings (the `engine` keys, which settings.py reads into
EngineSettings), and what the job derived from its model and device.

One config travels from the settings to the engine: the settings as they were read, never copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSettings:
    """The `engine` keys. The defaults are conf/config.yaml's, for engines built without a job (tests,
    benchmarks); a job sets every field from its config."""

    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_batched_tokens: int | str = 2048  # or "auto": sized to the device
    max_num_seqs: int | str = 256  # or "auto"
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
