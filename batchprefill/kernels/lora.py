"""LoRA deltas for many adapters in one step, and the torch grouped path (the CPU path, and the Triton kernel's
reference).

Each adapter adds `(x @ A.T) @ (scale * B).T` to the projections it targets (S-LoRA, Punica). The base weights
are shared, so a step's tokens run the base linear together and only the small delta is per adapter: tokens are
grouped by adapter (as `kernels/experts.py` groups them by expert) and each adapter with tokens runs one shrink
(`x A`, all the fused projection's parts at once) and one expand (`B`, its parts in one matrix) over its rows.
The order stage keeps an adapter's rows together, so a group is nearly always one contiguous run of the flat
batch: a slice, no gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from batchprefill.kernels.linear import in_fixed_slices

LoraHook = Callable[[str, torch.Tensor, torch.Tensor], None]  # (slot, output, input): adds the step's deltas


@dataclass
class LoraPart:
    """One adapter's B for a span of a fused projection's outputs (q, k or v of QKV; all of Phi-3's qkv_proj)."""

    out_start: int
    out_stop: int
    rank_start: int  # its columns of the shrink's output: the A rows it pairs with
    rank_stop: int
    b: torch.Tensor  # [out_stop - out_start, rank_stop - rank_start], the scale folded in


@dataclass
class AdapterDelta:
    """One adapter's LoRA on one projection: the A of every part stacked (one shrink) and each part's B."""

    a: torch.Tensor  # [rank, in]
    parts: list[LoraPart]
    _dense: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def dense(self, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A.T `[in, rank]` and every part's B in one matrix, transposed `[rank, out]` (zeros off the parts), for
        the torch path: one expand per adapter, added in place into whole rows of the output. Adding a part into
        its column slice of the output instead cost 12 ms per call on 512 rows (a strided in-place matmul), and
        an expand into a new tensor 14 ms (fresh pages), against 1 ms for the whole-row in-place add."""
        if self._dense is None:
            b = torch.zeros(self.a.shape[0], out_features, dtype=self.a.dtype, device=self.a.device)
            for part in self.parts:
                b[part.rank_start : part.rank_stop, part.out_start : part.out_stop] = part.b.t()
            self._dense = self.a.t().contiguous(), b
        return self._dense


@dataclass
class LoraWeights:
    """One projection of one layer (qkv, o, gate_up or down) under every adapter that targets it."""

    in_features: int
    out_features: int
    adapters: dict[int, AdapterDelta]  # adapter index (from 1; 0 is the base model) -> its delta
    _stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A `[N + 1, R, in]` and B `[N + 1, out, R]` for adapter indices 0..N, ranks zero-padded to the largest R
        (a part's B sits at its outputs and ranks, zeros elsewhere), and each index's rank `[N + 1]` int32 (0 where
        the adapter does not target this projection): the segmented kernel's layout, built on first use."""
        if self._stacked is None:
            some = next(iter(self.adapters.values())).a
            count, rank = max(self.adapters) + 1, max(delta.a.shape[0] for delta in self.adapters.values())
            a = torch.zeros(count, rank, self.in_features, dtype=some.dtype, device=some.device)
            b = torch.zeros(count, self.out_features, rank, dtype=some.dtype, device=some.device)
            ranks = torch.zeros(count, dtype=torch.int32)
            for index, delta in self.adapters.items():
                a[index, : delta.a.shape[0]] = delta.a
                ranks[index] = delta.a.shape[0]
                for part in delta.parts:
                    b[index, part.out_start : part.out_stop, part.rank_start : part.rank_stop] = part.b
            self._stacked = a, b, ranks.to(some.device)
        return self._stacked


@dataclass
class LoraStep:
    """Which tokens of a step's flat batch run which adapter, laid out once per step for every layer.

    `groups`: per adapter with tokens, its rows (a slice when they are one run, else an index tensor), for the
    torch path. `segments`: `[3, S]` int32 (start, length, adapter) of each run of one adapter's tokens, and
    the longest run, for the segmented kernel."""

    groups: list[tuple[int, slice | torch.Tensor]]
    segments: torch.Tensor
    longest: int

    @classmethod
    def of(cls, token_adapters: np.ndarray, device: torch.device) -> LoraStep | None:
        """From each token's adapter index `[T]` (0: the base model); None when no token runs an adapter."""
        if not token_adapters.any():
            return None
        bounds = np.flatnonzero(np.diff(token_adapters)) + 1
        starts = np.concatenate([[0], bounds])
        stops = np.concatenate([bounds, [len(token_adapters)]])
        adapters = token_adapters[starts]
        runs: dict[int, list[tuple[int, int]]] = {}
        for start, stop, adapter in zip(starts.tolist(), stops.tolist(), adapters.tolist()):
            if adapter:
                runs.setdefault(adapter, []).append((start, stop))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for adapter, spans in runs.items():
            if len(spans) == 1:
                groups.append((adapter, slice(*spans[0])))
            else:
                rows = np.concatenate([np.arange(start, stop) for start, stop in spans])
                groups.append((adapter, torch.from_numpy(rows).to(device)))
        lora = adapters != 0
        segments = np.stack([starts[lora], stops[lora] - starts[lora], adapters[lora]]).astype(np.int32)
        return cls(groups, torch.from_numpy(segments).to(device), int((stops - starts)[lora].max()))


def torch_lora(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, step: LoraStep,
               batch_invariant: bool = False) -> None:
    """Add every adapter's delta to its own tokens' rows of `out` `[T, out]`, from the projection's input `x`
    `[T, in]`: per adapter one shrink and one expand over its rows, added in place. `batch_invariant`: both
    products in fixed row slices (`linear.in_fixed_slices`), so a row's delta does not depend on how many
    tokens its adapter has this step."""
    for adapter, rows in step.groups:
        delta = weights.adapters.get(adapter)
        if delta is None:  # this adapter does not target this projection
            continue
        a_t, b_t = delta.dense(weights.out_features)
        if batch_invariant:
            shrunk = in_fixed_slices(partial(torch.mm, mat2=a_t), x[rows])
            out[rows] += in_fixed_slices(partial(torch.mm, mat2=b_t), shrunk)
        elif isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ a_t, b_t)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
