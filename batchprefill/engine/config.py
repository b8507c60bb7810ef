"""What the engine is built from: the job's engine settings, and what the job derived from its model and device.

One config travels from the settings to the engine: the settings as they were read, never copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchprefill.settings import EngineSettings


@dataclass(frozen=True)
class EngineConfig:
    settings: EngineSettings
    num_blocks: int  # the KV pool, sized from the model, the device's free memory and what the job needs
    padded_decode: str = "off"  # "graphs" on CUDA: decode-only steps replay captured CUDA graphs
