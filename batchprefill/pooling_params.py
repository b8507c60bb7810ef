"""How task=embed turns a row's hidden states into one vector (`model.pooling`, `model.normalize`): plain data
shared by the settings and the task, as sampling_params is."""

from __future__ import annotations

from dataclasses import dataclass

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    kind: str = "last"  # "last": the last prompt token's final-norm hidden state; "mean": the mean over the prompt
    normalize: bool = True  # scaled to unit L2 norm
