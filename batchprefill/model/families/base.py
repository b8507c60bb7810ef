"""What a model family is to the decoder: a config parser and a builder for one layer's weights.

The decoder (`batchprefill/model/decoder.py`) runs one Llama-shaped skeleton for every family; a family
file says only how its `config.json` and weight names map onto that skeleton. The builders here are
Llama's; a family reuses them and replaces the part that differs (fused projections, extra norms, an MLP
kind). An MLP is any callable from `[T, hidden]` and the compute backend to `[T, hidden]`, so a new kind
(mixture of experts, whose experts run in a backend kernel) is a class, not an edit to the decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchprefill.kernels.fp8 import Fp8Weight, concat_weights
from batchprefill.kernels.interface import Ops
from batchprefill.kernels.linear import Linear
from batchprefill.kernels.lora import LoraHook
from batchprefill.kernels.torch.elementwise import ACTIVATIONS
from batchprefill.model.config import ModelConfig

# Name -> tensor; a dense layer's linear weight may be an Fp8Weight on a GPU (model/quantization.py).
Weights = dict[str, torch.Tensor | Fp8Weight]
MLP = Callable[[torch.Tensor, Ops], torch.Tensor]


@dataclass
class Layer:
    """One decoder layer's weights, in the skeleton's order: norm, attention, [norm], norm, MLP, [norm]."""

    input_norm: torch.Tensor
    qkv: Linear  # Q, K and V in one matrix: [q_size + 2 * kv_size, hidden]
    o: Linear
    pre_mlp_norm: torch.Tensor
    mlp: MLP
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of queries and keys before RoPE
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None  # on the attention output, before the residual add
    post_mlp_norm: torch.Tensor | None = None  # on the MLP output, before the residual add


class GatedMLP:
    """down(act(gate(x)) * up(x)), gate and up in one matrix (one matmul instead of two), the activation and product
    in one backend op (`Ops.gated_activation`)."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        self.gate_up = gate_up
        self.down = down
        self.activation = activation

    def __call__(self, x: torch.Tensor, ops: Ops, lora: LoraHook | None = None) -> torch.Tensor:
        """`lora` adds the step's adapter deltas to gate_up's and down's outputs (model/adapters.py)."""
        if lora is None:
            return self.down(ops.gated_activation(self.gate_up(x), self.activation))
        gate_up = self.gate_up(x)
        lora("gate_up", gate_up, x)
        act = ops.gated_activation(gate_up, self.activation)
        out = self.down(act)
        lora("down", out, act)
        return out


@dataclass(frozen=True)
class Family:
    """A model family: the architectures it covers, how to read their config, how to build a layer."""

    name: str
    architectures: tuple[str, ...]
    config: Callable[[dict, str], ModelConfig]  # (config.json as a dict, architecture) -> ModelConfig
    layer: Callable[[Weights, int, ModelConfig], Layer]  # (weights, layer index, config) -> Layer


def norm(weights: Weights, name: str, config: ModelConfig) -> torch.Tensor:
    """An RMSNorm weight as the norm op multiplies by it: Gemma's (1 + w) is folded in once, in float32 as
    Gemma computes it (the norm ops upcast the weight anyway)."""
    weight = weights[name]
    return weight.float() + config.norm_offset if config.norm_offset else weight


def separate_qkv(weights: Weights, prefix: str, config: ModelConfig) -> Linear:
    """q_proj, k_proj and v_proj (with biases where the config has them) fused into one linear; FP8 weights keep
    each row's scale."""
    attn = prefix + "self_attn."
    bias = torch.cat([weights[attn + f"{p}_proj.bias"] for p in "qkv"]) if config.qkv_bias else None
    return Linear(concat_weights([weights[attn + f"{p}_proj.weight"] for p in "qkv"]), bias)


def separate_gate_up(weights: Weights, prefix: str, config: ModelConfig) -> GatedMLP:
    mlp = prefix + "mlp."
    gate_up = concat_weights([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]])
    return GatedMLP(Linear(gate_up), Linear(weights[mlp + "down_proj.weight"]), config.hidden_act)


def llama_layer(weights: Weights, index: int, config: ModelConfig, mlp: MLP | None = None) -> Layer:
    """Llama's layer, with q/k norms where the config has them (Qwen3). `mlp` replaces the gated MLP."""
    prefix = f"model.layers.{index}."
    attn = prefix + "self_attn."
    return Layer(
        input_norm=norm(weights, prefix + "input_layernorm.weight", config),
        qkv=separate_qkv(weights, prefix, config),
        o=Linear(weights[attn + "o_proj.weight"]),
        pre_mlp_norm=norm(weights, prefix + "post_attention_layernorm.weight", config),
        mlp=mlp if mlp is not None else separate_gate_up(weights, prefix, config),
        q_norm=norm(weights, attn + "q_norm.weight", config) if config.qk_norm else None,
        k_norm=norm(weights, attn + "k_norm.weight", config) if config.qk_norm else None,
    )
