"""Linear layers whose weights are laid out once, at load, for the device's matrix-multiply library.

On a CPU, `F.linear` hands the plain `[out, in]` weight to the BLAS, which re-packs it into its blocked
layout on every call. oneDNN can take the weight already reordered: on this model's shapes that is 1.1-1.2x
faster for prefill steps, 1.2-1.8x for decode batches and 1.9-2.8x for the LM head (BENCHMARKS.md, "The CPU
path's hot ops against plain torch").
GPUs, and dtypes oneDNN does not take natively, keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether this weight can run as a prepacked oneDNN matmul: float32 anywhere oneDNN is built in, bfloat16
    only where the CPU has native bfloat16 instructions (elsewhere oneDNN would emulate them slowly)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """`y = x @ weight.T + bias`, with the weight prepacked where the device allows it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.packed = onednn_packs(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
