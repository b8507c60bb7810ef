"""Mixture-of-experts weights and the torch grouped-expert path (the CPU path, and the Triton kernel's reference).

A step's tokens are routed to `top_k` experts each. Rather than loop over tokens, the (token, slot) pairs are
sorted by expert, so each expert runs once, as two matmuls over all the rows routed to it; its rows, times
their router weights, go back to pair order and are summed over each token's slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchprefill.kernels.fp8 import Fp8Weight, concat_weights, stack_weights
from batchprefill.kernels.linear import Linear, building_batch_invariant


class ExpertWeights:
    """One MoE layer's SwiGLU experts: `down(silu(gate(x)) * up(x))` for expert e.

    Held stacked, as the fused kernel reads them: gate_up `[E, 2I, H]` (gate rows first, then up rows) and
    down `[E, H, I]`; on a GPU an FP8 checkpoint's experts stay FP8 with their scales stacked alike (`Fp8Weight`,
    per channel `[E, rows]` or per block), which the fused kernel widens in registers. The torch path wants one
    prepacked matrix per expert instead (`Linear`: oneDNN's packed layout runs SmolLM2's projections 1.1-1.8x
    faster than `F.linear`, BENCHMARKS.md): `linears` builds them on first use and, where that packing copied the
    weights, drops the stacked tensors, so the layer is held once in whichever layout its backend runs.
    """

    def __init__(self, gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight):
        self.num_experts, self.intermediate_size = gate_up.shape[0], down.shape[2]
        self.gate_up: torch.Tensor | Fp8Weight | None = gate_up
        self.down: torch.Tensor | Fp8Weight | None = down
        self._linears: list[tuple[Linear, Linear]] = []
        self._batch_invariant = building_batch_invariant()  # the linears are built later, at first use

    @classmethod
    def stack(cls, gates: list[torch.Tensor | Fp8Weight], ups: list[torch.Tensor | Fp8Weight],
              downs: list[torch.Tensor | Fp8Weight]) -> ExpertWeights:
        """From per-expert `[I, H]` gate and up and `[H, I]` down matrices, the layout checkpoints store. FP8
        experts stay FP8 where all of a stack's are (gate and up fuse as `concat_weights` allows: whole blocks);
        else that stack is dequantized (each of the two kernels takes its own weights' precision)."""
        gate_up = stack_weights([concat_weights([gate, up]) for gate, up in zip(gates, ups, strict=True)])
        return cls(gate_up, stack_weights(downs))

    def stacked(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        if self.gate_up is None or self.down is None:
            raise ValueError("these expert weights were packed for the CPU's torch path; the fused kernel needs them "
                             "stacked on the GPU")
        return self.gate_up, self.down

    @property
    def linears(self) -> list[tuple[Linear, Linear]]:
        """(gate_up, down) per expert, prepacked where the device allows it."""
        if not self._linears:
            gate_up, down = self.stacked()
            invariant = self._batch_invariant
            self._linears = [(Linear(_expert(gate_up, e), batch_invariant=invariant),
                              Linear(_expert(down, e), batch_invariant=invariant)) for e in range(self.num_experts)]
            if self._linears[0][0].packed:
                self.gate_up = self.down = None
        return self._linears


def _expert(weights: torch.Tensor | Fp8Weight, index: int) -> torch.Tensor | Fp8Weight:
    return weights.select(index) if isinstance(weights, Fp8Weight) else weights[index]


def torch_experts(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, H]` -> `[T, H]`: the sum over each token's `topk_ids` `[T, K]` of its expert outputs, each times its
    router weight from `topk_weights` `[T, K]` (float32; multiplied in the hidden dtype, as transformers does).

    One pass per expert that has tokens; the host learns the per-expert counts once per call. Each pass copies
    its weighted rows to their pair positions, then one sum over the K slots (`index_add_` into the output
    costs the same on one thread, but was 60% of a two-thread profile of a 2048-token step). Against a dense
    MLP of the same active width (8 experts top-2 of width 768 against width 1536, hidden 512, one thread;
    BENCHMARKS.md): 1.19x the dense time at 2048 tokens, 1.9x at 64 and 3.3x at 16, where all 8 experts'
    weights are read for few rows.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # pair positions grouped by expert
    sorted_rows = hidden[order // top_k]
    sorted_weights = topk_weights.flatten()[order].to(hidden.dtype)[:, None]
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    by_pair = torch.empty_like(sorted_rows)
    start = 0
    for (gate_up, down), count in zip(experts.linears, counts, strict=True):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = gate_up(sorted_rows[rows]).chunk(2, dim=-1)
        by_pair.index_copy_(0, order[rows], down(F.silu(gate).mul_(up)).mul_(sorted_weights[rows]))
        start += count
    return by_pair.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1)
