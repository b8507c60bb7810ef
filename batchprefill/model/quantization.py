"""Which quantization a model's linear weights carry: read from `config.json`'s `quantization_config`, or asked
for with `model.quantization=fp8`.

Two FP8 checkpoint formats are read, as HF folders hold them:
- compressed-tensors `float-quantized` (llm-compressor's `-FP8-dynamic` and `-FP8` releases): each quantized
  linear stores `weight` in float8_e4m3fn beside `weight_scale`, one scale per output channel (strategy
  `channel`), one per tensor (`tensor`) or one per block (`block`, its `block_structure`); activations are
  quantized per token at run time (`input_activations` with `dynamic: true`) or not at all (weight-only).
- `quant_method: fp8` with `weight_block_size` [128, 128] and `activation_scheme: dynamic` (Qwen3's and
  DeepSeek-V3's FP8 releases): `weight` in float8_e4m3fn beside `weight_scale_inv`
  `[ceil(out / 128), ceil(in / 128)]`; a block's weights are its FP8 values times its scale (the `_inv` says the
  scale maps FP8 back to the weight's range).
Any other quantization (AWQ, GPTQ, bitsandbytes, integer schemes, static activation scales) is refused by name:
loading its packed or scaled tensors as plain weights would run silently wrong. Modules a checkpoint leaves
unquantized (its `ignore` or `modules_to_not_convert` list: lm_head, routers) are stored in 16 bits with no
scale, and load as any weight does (model/weights.py tells them apart by their dtype).

`model.quantization=fp8` quantizes a 16-bit checkpoint's decoder-layer linears at load, with one scale per
output channel and activations scaled per token at run time: no calibration data is needed (static activation
scales need a calibration set to choose them), a per-token scale follows each row's own range so one outlier
token does not flatten the others, and it is the scheme of the -FP8-dynamic checkpoints, which Hopper's
row-wise `_scaled_mm` takes in one call: one GPU path serves both. Embeddings, the LM head and norms stay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchprefill.kernels.fp8 import block_kernel_takes

# A decoder layer's dense linear weights: what a GPU may hold in FP8 and `model.quantization=fp8` quantizes
# (routers are not among them, nor experts, which only an FP8 checkpoint holds in FP8: EXPERT_LINEAR).
DENSE_LINEAR = re.compile(r"^(model\.)?layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
                          r"\.weight$")
# One expert's projection in a mixture-of-experts layer (Qwen3-MoE's names, then Mixtral's): an FP8 checkpoint's
# stay FP8 on a GPU, where the fused experts' kernel widens them in registers (`kernels/triton/moe.py`).
EXPERT_LINEAR = re.compile(r"^(model\.)?layers\.\d+\.(mlp\.experts\.\d+\.(gate|up|down)_proj"
                           r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
QUANTIZATIONS = ("fp8",)  # model.quantization's values besides null
SUPPORTED = ("FP8 checkpoints are read: compressed-tensors float-quantized, and quant_method fp8 with dynamic "
             "activations")


class UnsupportedQuantization(ValueError):
    pass


@dataclass(frozen=True)
class Quantization:
    """How a model's linear weights are held: FP8 values with scales."""

    format: str  # "compressed-tensors", "fp8" (quant_method fp8), or "fp8 at load" (model.quantization=fp8)
    block: tuple[int, int] | None = None  # the weight scales' block (out, in); None: per channel or per tensor
    dynamic_activations: bool = True  # activations quantized per token at run time (W8A8); False: weight-only
    at_load: bool = False  # quantized at load from a 16-bit checkpoint

    @property
    def multiplies_fp8(self) -> bool:
        """Whether a GPU holds these weights in FP8 and multiplies them so (`kernels/fp8.py`: widened in registers
        for a decode step's few rows; past them per-channel or per-tensor weight scales through `_scaled_mm`'s
        row-wise path, block scales through the block kernel), where the checkpoint quantizes its activations too.
        The weights of a weight-only checkpoint are dequantized to bfloat16 on the GPU at load (exact, at twice
        the bytes): quantizing their activations past a decode step's rows would add an error the checkpoint does
        not have."""
        return self.dynamic_activations and (self.block is None or block_kernel_takes(self.block))

    def describe(self) -> str:
        """For the run's summary and the prefix cache's scope: "FP8 weights (compressed-tensors, per channel)"."""
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per channel"
        activations = "" if self.dynamic_activations else ", weight-only"
        return f"FP8 weights ({self.format}, {scales}{activations})"


def read_quantization(raw: dict) -> Quantization | None:
    """The checkpoint's quantization from its config.json (as a dict), None when it has none; an
    UnsupportedQuantization naming any other."""
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _fp8(config)
    raise UnsupportedQuantization(f"quantization_config quant_method {method!r} is not supported; {SUPPORTED}")


def _fp8(config: dict) -> Quantization:
    """`quant_method: fp8` (transformers' FineGrainedFP8Config, vLLM's Fp8Config)."""
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise UnsupportedQuantization(f"quant_method fp8 with activation_scheme {activations!r} (static activation "
                                      f"scales) is not supported; {SUPPORTED}")
    block = config.get("weight_block_size")
    return Quantization("fp8", tuple(int(size) for size in block) if block else None)


def _compressed_tensors(config: dict) -> Quantization:
    """compressed-tensors: every config group must be 8-bit float weights with channel, tensor or block scales;
    one block shape and one activation scheme for the whole model."""
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantization("compressed-tensors quantization_config without config_groups is not supported")
    schemes = {_compressed_group(group, config.get("format")) for group in groups}
    if len(schemes) > 1:
        raise UnsupportedQuantization(f"compressed-tensors with config groups of different schemes ({len(schemes)}) "
                                      f"is not supported; {SUPPORTED}")
    block, dynamic = schemes.pop()
    return Quantization("compressed-tensors", block, dynamic)


def _compressed_group(group: dict, model_format: str | None) -> tuple[tuple[int, int] | None, bool]:
    """(weight block or None, dynamic activations) of one config group."""
    group_format = group.get("format") or model_format
    weights = group.get("weights") or {}
    kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights, format {group_format}"
    if group_format != "float-quantized" or weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedQuantization(f"compressed-tensors with {kind} is not supported; {SUPPORTED}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block") or weights.get("symmetric") is False or weights.get("dynamic"):
        raise UnsupportedQuantization(f"compressed-tensors FP8 weights with strategy {strategy!r} (symmetric: "
                                      f"{weights.get('symmetric')}, dynamic: {weights.get('dynamic')}) are not "
                                      f"supported; {SUPPORTED}")
    block = tuple(int(size) for size in weights["block_structure"]) if strategy == "block" else None
    activations = group.get("input_activations")
    if activations and not activations.get("dynamic"):
        raise UnsupportedQuantization("compressed-tensors FP8 with static activation scales (input_activations "
                                      f"dynamic: false) is not supported; {SUPPORTED}")
    return block, bool(activations)


def job_quantization(checkpoint: Quantization | None, setting: str | None) -> Quantization | None:
    """What a job runs: the checkpoint's quantization, or with `model.quantization=fp8` a 16-bit checkpoint's
    linears quantized at load (an FP8 checkpoint is FP8 already and loads as it is)."""
    if setting is None or checkpoint is not None:
        return checkpoint
    if setting not in QUANTIZATIONS:
        raise UnsupportedQuantization(f"model.quantization={setting!r}: choose null or {' or '.join(QUANTIZATIONS)}")
    return Quantization("fp8 at load", at_load=True)
