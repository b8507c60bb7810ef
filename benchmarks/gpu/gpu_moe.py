"""The fused Triton MoE against the per-expert torch loop (`torch_experts`, the CPU path run on the GPU).

Two layer shapes: Mixtral-8x7B (8 experts of width 14336, top-2, hidden 4096) and Qwen3-30B-A3B (128 experts of
width 768, top-8, hidden 2048), bf16, at decode and prefill token counts. Each row first checks the fused result
and the loop against a float32 loop (ERROR_RATIO), then times both; the fused one also under a CUDA-graph replay
where the tokens are few (decode), which only works if its expert sort never syncs with the host.

Then the same experts in an FP8 checkpoint's block-wise format (128 x 128 blocks), which the fused kernels widen in
registers: a row records whether their output has the bits of the bf16 experts they dequantize to (the widened
tiles are those bits, so it should; the CPU interpreter's test asserts it), its largest difference, and the FP8
time beside the bf16 one (half the weight bytes, which decode steps read in full).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from batchprefill.kernels.experts import ExpertWeights, torch_experts
from batchprefill.kernels.fp8 import FP8, FP8_MAX, Fp8Weight
from batchprefill.kernels.triton.moe import fused_experts
from batchprefill.model.moe import route


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    width: int
    experts: int
    top_k: int
    tokens: tuple[int, ...]


FULL = (MoeShape("mixtral-8x7b", 4096, 14336, 8, 2, (1, 16, 256, 2048)),
        MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, (1, 16, 256, 2048)))
SMOKE = (MoeShape("smoke", 64, 32, 4, 2, (1, 9)),)
GRAPH_MAX_TOKENS = 256
# The fused kernel and the loop both round to bf16, in different orders; each is measured against a float32 loop on
# the same (bf16-valued) inputs, and the fused one may be off by at most twice the loop's own error plus one bf16
# step of the output's largest value. A flat 2e-2 between the two failed at Mixtral's shape, 2,048 tokens (0.0234
# on the first H200 run): three bf16 steps of outputs near 1, rounding, not a fault.
ERROR_RATIO = 2.0


def random_experts(s: MoeShape, dtype: torch.dtype, device: torch.device) -> ExpertWeights:
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(s.experts, 2 * s.width, s.hidden, generator=gen, device=device) * s.hidden**-0.5
    down = torch.randn(s.experts, s.hidden, s.width, generator=gen, device=device) * s.width**-0.5
    return ExpertWeights(gate_up.to(dtype), down.to(dtype))


def quantize_blocks(weights: torch.Tensor, block: int = 128) -> Fp8Weight:
    """A matrix `[rows, columns]`, or a stack of them `[E, rows, columns]`, in the block-wise checkpoints' FP8: one
    scale per `block` x `block` weights, the block's largest magnitude mapped to 448."""
    stack = weights.float().reshape(-1, *weights.shape[-2:])
    count, rows, columns = stack.shape
    grid = (-(-rows // block), -(-columns // block))
    padded = torch.nn.functional.pad(stack, (0, grid[1] * block - columns, 0, grid[0] * block - rows))
    tiles = padded.view(count, grid[0], block, grid[1], block)
    scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX
    values = (tiles / scale[:, :, None, :, None]).to(FP8).view(padded.shape)[:, :rows, :columns].contiguous()
    return Fp8Weight(values.view(weights.shape), scale.view(*weights.shape[:-2], *grid), (block, block))


def fp8_experts(experts: ExpertWeights) -> tuple[ExpertWeights, ExpertWeights]:
    """(the experts in block-wise FP8, the same dequantized to bf16 at load)."""
    stacks = [quantize_blocks(matrices) for matrices in experts.stacked()]
    dequantized = [torch.stack([w.select(e).dequantize(torch.bfloat16) for e in range(w.shape[0])]) for w in stacks]
    return ExpertWeights(*stacks), ExpertWeights(*dequantized)


def run(smoke: bool, device: torch.device, bench: Callable[..., float]) -> list[dict]:
    """Rows of (shape, tokens, fused ms, loop ms, speed-up); raises if the fused result is off."""
    dtype, rows = torch.bfloat16, []
    for s in SMOKE if smoke else FULL:
        experts = random_experts(s, dtype, device)
        loop_experts = ExpertWeights(experts.gate_up, experts.down)  # the loop may repack its own, on a CPU
        in_fp8, dequantized = fp8_experts(experts)
        for tokens in s.tokens:
            gen = torch.Generator(device=device).manual_seed(tokens)
            x = torch.randn(tokens, s.hidden, generator=gen, device=device).to(dtype)
            weights, ids = route(torch.randn(tokens, s.experts, generator=gen, device=device), s.top_k, True)
            fused = partial(fused_experts, x, experts, weights, ids)
            loop = partial(torch_experts, x, loop_experts, weights, ids)
            exact = torch_experts(x.float(), ExpertWeights(experts.gate_up.float(), experts.down.float()), weights,
                                  ids)
            error, loop_error = ((f().float() - exact).abs().max().item() for f in (fused, loop))
            bound = ERROR_RATIO * loop_error + exact.abs().max().item() * 2**-8
            if error > bound:
                raise AssertionError(f"fused MoE {s.name} at {tokens} tokens is {error:.3g} off a float32 loop, "
                                     f"where the bf16 loop is {loop_error:.3g} off (bound {bound:.3g})")
            del exact
            fused_ms, loop_ms = bench(fused, device), bench(loop, device)
            graph_ms = None
            if device.type == "cuda" and tokens <= GRAPH_MAX_TOKENS:
                graph_ms = bench(fused, device, graph=True)
            flops = 2 * tokens * s.top_k * 3 * s.hidden * s.width
            fp8 = partial(fused_experts, x, in_fp8, weights, ids)
            fp8_out, want = fp8(), fused_experts(x, dequantized, weights, ids)
            fp8_ms, dequantized_ms = bench(fp8, device), bench(partial(fused_experts, x, dequantized, weights, ids),
                                                               device)
            rows.append({"shape": s.name, "tokens": tokens, "fused_ms": fused_ms, "fused_graph_ms": graph_ms,
                         "torch_loop_ms": loop_ms, "speed_vs_loop": loop_ms / fused_ms,
                         "fused_tflops": flops / fused_ms / 1e9, "max_error_vs_fp32": error,
                         "loop_max_error_vs_fp32": loop_error, "fp8_experts_ms": fp8_ms,
                         "dequantized_experts_ms": dequantized_ms, "speed_fp8_vs_bf16": dequantized_ms / fp8_ms,
                         "fp8_same_bits": bool(torch.equal(fp8_out, want)),
                         "fp8_max_difference": (fp8_out.float() - want.float()).abs().max().item()})
        del experts, loop_experts, in_fp8, dequantized
    return rows
