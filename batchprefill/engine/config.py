"""What the engine is built from: its block pool, step budget and policies, fixed for a job."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_blocks: int = 1024
    prefix_caching: bool = True
    cache_namespace: str = "default"
    reserve_output_blocks: bool = True  # admit a request only if its prompt and max_tokens outputs fit
    padded_decode: str = "off"  # "graphs" on CUDA: decode-only steps replay captured CUDA graphs
