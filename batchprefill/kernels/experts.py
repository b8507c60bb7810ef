"""Mixture-of-experts weights and the torch grouped-expert path (the CPU path, and the Triton kernel's reference).

A step's tokens are routed to `top_k` experts each. Rather than loop over tokens, the (token, slot) pairs are
sorted by expert, so each expert runs once, as two matmuls over all the rows routed to it, and the results are
put back in pair order and summed over the slots with their router weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's SwiGLU experts, stacked: `down(silu(gate(x)) * up(x))` for expert e.

    gate_up: `[E, 2I, H]`, gate rows first, then up rows; down: `[E, H, I]`. Both backends read this layout,
    so the weights are held once.
    """

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @classmethod
    def stack(cls, gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor]) -> ExpertWeights:
        """From per-expert `[I, H]` gate and up and `[H, I]` down matrices, the layout checkpoints store."""
        gate_up = torch.stack([torch.cat([gate, up]) for gate, up in zip(gates, ups, strict=True)])
        return cls(gate_up=gate_up, down=torch.stack(downs))


def torch_experts(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, H]` -> `[T, H]`: the sum over each token's `topk_ids` `[T, K]` of its expert outputs, each times its
    router weight from `topk_weights` `[T, K]` (float32; multiplied in the hidden dtype, as transformers does).

    One pass per expert that has tokens; the host learns the per-expert counts once per call.
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(hidden)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # pair positions grouped by expert
    sorted_rows = hidden[order // top_k]
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    outputs = torch.empty_like(sorted_rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = F.linear(sorted_rows[rows], experts.gate_up[expert]).chunk(2, dim=-1)
        outputs[rows] = F.linear(F.silu(gate) * up, experts.down[expert])
        start += count
    by_pair = torch.empty_like(outputs)
    by_pair[order] = outputs
    weights = topk_weights.to(hidden.dtype).view(num_tokens, top_k, 1)
    return (by_pair.view(num_tokens, top_k, -1) * weights).sum(dim=1)
