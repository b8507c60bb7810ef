"""Linear layers whose weights are laid out once, at load, for the device's matrix-multiply library.

On a CPU, `F.linear` hands the plain `[out, in]` weight to the BLAS, which re-packs it into its blocked
layout on every call. oneDNN can take the weight already reordered: on this model's shapes that is 1.1-1.2x
faster for prefill steps, 1.2-1.8x for decode batches and 1.9-2.8x for the LM head (BENCHMARKS.md, "The CPU
path's hot ops against plain torch").
GPUs, and dtypes oneDNN does not take natively, keep `F.linear`. A weight held in FP8 (`kernels/fp8.py`, on a GPU
only) multiplies in FP8.

Batch invariance (`engine.batch_invariant`): a row's product must not depend on how many rows share the call.
The libraries choose their kernels, and with them the order of the inner sums, from the shape: measured on an
Intel Xeon with AMX (2 threads), oneDNN's bfloat16 products of SmolLM2's QKV and MLP shapes fall into two or
three classes of differing bits by row count (1-32 rows, 33-200, 1024...) with no threshold above which they
agree, and float32's down projection differs between 1 row and any other count. So an invariant linear
multiplies in slices of exactly `INVARIANT_ROWS` rows, the last one padded with zeros: every call then has one
shape, and each row's sums come out the same wherever it sits in its slice (tests/test_batch_invariance.py
checks both). On a GPU the slices are a Triton matmul with fixed tiles and no split of the inner dimension
(`kernels/triton/matmul.py`). The choice is made once, when a model builds its layers
(`batch_invariant_linears`, which `DecoderModel` enters with its backend's setting): every layer then calls
one function, with no flag read per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from batchprefill.intmath import cdiv
from batchprefill.kernels.fp8 import Fp8Weight, fp8_linear

# Rows per slice of an invariant CPU linear. The measured cost against one call over all rows is in
# BENCHMARKS.md ("Batch invariance"); 128 was the cheapest of 32, 64, 128 and 256 over decode batches of 80 and
# prefill steps of 2048 tokens in bfloat16.
INVARIANT_ROWS = 128

_BATCH_INVARIANT: ContextVar[bool] = ContextVar("batch_invariant_linears", default=False)


@contextmanager
def batch_invariant_linears(enabled: bool) -> Iterator[None]:
    """Linears built inside run batch-invariant (`enabled`) or at full speed: how vLLM's layers read the config
    current at construction, so no family's builder takes a flag."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def building_batch_invariant() -> bool:
    """Whether the linears built now must be batch-invariant (for objects that build theirs later)."""
    return _BATCH_INVARIANT.get()


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether this weight can run as a prepacked oneDNN matmul: float32 anywhere oneDNN is built in, bfloat16
    only where the CPU has native bfloat16 instructions (elsewhere oneDNN would emulate them slowly)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def in_fixed_slices(multiply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                    rows: int = INVARIANT_ROWS) -> torch.Tensor:
    """`multiply(x)` for `x` `[M, in]` computed `rows` rows at a time, the last slice padded with zeros, so every
    call has the same shape whatever M is."""
    count = x.shape[0]
    padded = cdiv(max(count, 1), rows) * rows
    if padded != count:
        x = F.pad(x, (0, 0, 0, padded - count))
    if padded == rows:
        return multiply(x)[:count]
    return torch.cat([multiply(x[start : start + rows]) for start in range(0, padded, rows)])[:count]


class Linear:
    """`y = x @ weight.T + bias`, with the weight prepacked where the device allows it; batch-invariant when
    built inside `batch_invariant_linears(True)` (or with `batch_invariant=True`). An `Fp8Weight` multiplies
    through `fp8_linear` (its weights widened up to WIDENED_ROWS rows, in FP8 past them); batch-invariant, it runs
    in fixed slices as the CPU does, so every call is one 128-row FP8 product, since `_scaled_mm` too picks its
    kernel by shape (the per-row activation scales depend on each row alone)."""

    def __init__(self, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                 batch_invariant: bool | None = None):
        self.bias = bias
        self.packed = isinstance(weight, torch.Tensor) and onednn_packs(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if self.packed else weight
        self.batch_invariant = building_batch_invariant() if batch_invariant is None else batch_invariant
        self._forward = self._pick()

    def _pick(self) -> Callable[[torch.Tensor], torch.Tensor]:
        plain = self._fp8 if isinstance(self.weight, Fp8Weight) else self._packed if self.packed else self._plain
        if not self.batch_invariant:
            return plain
        if isinstance(self.weight, torch.Tensor) and self.weight.device.type == "cuda":
            from batchprefill.kernels.triton.matmul import invariant_linear  # triton only where it runs

            return lambda x: invariant_linear(x, self.weight, self.bias)
        return lambda x: in_fixed_slices(plain, x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)
