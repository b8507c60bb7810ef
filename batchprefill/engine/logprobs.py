"""Log-probabilities of the sampled tokens and the k most likely ones, for a whole step at once.

They are the raw model's (log-softmax of its logits, before temperature, top-k/top-p or a grammar), as vLLM
returns by default, computed on the device for every row that asked and copied to the host once per step.
"""

from __future__ import annotations

import numpy as np
import torch


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> np.ndarray:
    """`[R, 1 + 2k]` float64 on the host, one row per logits row: the chosen token's log-probability, then the ids
    of the k most likely tokens (exact as float64), then their log-probabilities, most likely first."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logits.device))
    top = logprobs.topk(k, dim=-1)
    return torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1).cpu().numpy()


def append_logprobs(output_logprobs: list[float], output_top: list[list[tuple[int, float]]], row: np.ndarray,
                    k: int) -> None:
    """Add one output token's entry from its row of `top_logprobs` (computed with at least k)."""
    width = (len(row) - 1) // 2
    output_logprobs.append(float(row[0]))
    output_top.append([(int(i), float(v)) for i, v in zip(row[1 : 1 + k], row[1 + width : 1 + width + k])])
