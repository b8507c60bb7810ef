"""How a request samples: plain data shared by the settings, the pipeline and the engine, so that reading the
settings imports no engine module."""

from __future__ import annotations

from dataclasses import dataclass

from batchprefill.constraint import Constraint


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # samples per prompt, each its own request forked from the prompt's KV
    logprobs: int | None = None  # None: off; k >= 0: each output token's logprob and the k most likely tokens'
    constraint: Constraint | None = None  # what every output must match (structured outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
