"""What every compute backend provides to the model, and the per-step metadata it reads.

Every backend implements the same functions with the same tensor layouts, so the model never knows which
one runs. The torch backend (`kernels/torch/ops.py`) is both the CPU path and the reference the Triton
kernels (`kernels/triton/ops.py`) are tested against; the CPU path's C++ kernels are in `kernels/native/`.

Layouts:
- flat batch: all query tokens of a step in one dimension `T` (prefill chunks and decodes mixed);
- KV cache of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, one tensor for K, one for V;
- a token's cache slot is `block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.lora import LoraStep, LoraWeights

if TYPE_CHECKING:
    from batchprefill.kernels.shared_prefix import DecodeGroups


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its KV lives in the pool."""

    query_start: torch.Tensor  # [S+1] int32: sequence s owns queries query_start[s]:query_start[s+1]
    seq_lens: torch.Tensor  # [S] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    query_lens_host: list[int]  # host copies, so no backend has to sync the device to loop
    seq_lens_host: list[int]
    plan: Any = None  # the backend's plan for this step (`Ops.plan`), built once and read by every layer
    # The block tables on the host ([S, width] int32, as `block_tables`), for plans that group sequences by the
    # blocks they share without reading the device; None where the caller has none.
    block_tables_host: np.ndarray | None = None
    # A decode-only step on fixed buffers (engine/decode_graphs.py): its decode groups (`Ops.group_decodes`) as
    # persistent device tensors, staged before each replay; the plan launches over all their slots.
    decode_groups: DecodeGroups | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_host)

    def with_plan(self, plan: Any) -> AttentionMetadata:
        return replace(self, plan=plan)


class Ops(Protocol):
    """What a compute backend provides to the model."""

    graph_safe_decode: bool  # a decode-only step launches fixed grids with no host sync: CUDA graphs can replay it
    batch_invariant: bool  # each row's results do not depend on what shares its step (engine.batch_invariant)

    def plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype
             ) -> AttentionMetadata:
        """`meta` with this backend's per-step plan attached: whatever host-side layout its attention needs,
        built once before the first layer instead of once per layer."""

    def group_decodes(self, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, heads_per_kv: int
                      ) -> DecodeGroups | None:
        """A decode-only step's groups of sequences sharing full blocks, as this backend's attention reads them
        from `AttentionMetadata.decode_groups` (None: it reads none, or no two sequences share a block). There are
        at most len(seq_lens) // 2 groups, so fixed buffers can hold any step's."""

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key/value `[T, Hkv, D]` into the paged caches at `slot_mapping` `[T]`."""

    def attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """Causal paged attention for a flat batch: query `[T, Hq, D]` -> `[T, Hq, D]`.

        Query j of sequence s sits at absolute position `p = seq_len - query_len + j` and attends to every
        cached position up to and including its own; with a sliding `window`, only to positions above
        `p - window`. Hq is a multiple of Hkv (GQA).
        """

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm with the residual add fused in: returns (norm(x + residual) * weight, x + residual).

        With no residual, the second value is x itself.
        """

    def rope(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE on query `[T, Hq, D]` and key `[T, Hkv, D]`.

        `cos_sin` is `[max_positions, D]`: the first D/2 columns are cos, the last D/2 sin.
        """

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """A gated MLP's `act(gate) * up`, `[T, I]`, from the fused gate and up projection `[T, 2I]` (gate first);
        `activation` one of `kernels/torch/elementwise.ACTIVATIONS`' names."""

    def moe(
        self, hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Mixture-of-experts MLP `[T, H]` -> `[T, H]`: each token's `topk_ids` `[T, K]` experts, weighted by
        `topk_weights` `[T, K]` (float32) and summed."""

    def lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, step: LoraStep) -> None:
        """Add to `out` `[T, out]`, in place, each token's adapter's LoRA delta of projection input `x` `[T, in]`:
        `(x A.T) B.T` with the scale folded into B, for the adapters `step` assigns (base-model tokens unchanged)."""
