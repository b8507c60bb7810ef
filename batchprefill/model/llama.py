"""A Llama-family decoder (Llama, SmolLM2, Qwen2) that runs one flat batch over a paged KV cache.

The forward pass knows nothing of requests or blocks: it gets token ids, positions, the per-layer
caches and attention metadata, and calls a compute backend (`Ops`) for every op that has a kernel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from batchprefill.kernels.interface import AttentionMetadata, Ops
from batchprefill.kernels.linear import Linear
from batchprefill.model.rope import rope_cos_sin

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True}  # name -> qkv bias


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """One K and one V vector per KV head per layer: the memory (and transfer) price of each token."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((Path(folder) / "config.json").read_text())
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        # transformers 5.x nests RoPE settings under rope_parameters; older files keep them top level.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = raw.get("eos_token_id", 2)
        heads = raw["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_positions=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=raw.get("attention_bias", SUPPORTED_ARCHITECTURES[arch]),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        )

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_element)

    def num_parameters(self) -> int:
        """Parameters in the linear layers and the LM head: the N of the 2·tokens·N FLOP estimate."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        per_layer = attention + 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size


class LlamaModel(torch.nn.Module):
    """Weights held as fused linears (QKV in one matrix, gate and up in one) to halve the op count."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops):
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = Linear(self.embed if config.tie_word_embeddings else weights["lm_head.weight"])
        self.layers = [_layer_weights(weights, f"model.layers.{i}.", config.qkv_bias) for i in range(config.num_layers)]
        self.cos_sin = rope_cos_sin(config.head_dim, config.max_positions, config.rope_theta, config.rope_scaling).to(
            self.embed.device
        )
        self.scale = config.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[len(logits_rows), vocab]` for the flat-batch rows that need a next token."""
        cfg, ops = self.config, self.ops
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden = F.embedding(input_ids, self.embed)
        meta = ops.plan(meta, kv_caches[0][0], cfg.num_heads, hidden.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            normed, residual = ops.rms_norm(hidden, layer["input_norm"], cfg.rms_norm_eps, residual)
            qkv = layer["qkv"](normed)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, cfg.num_heads, cfg.head_dim)
            k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            q, k = ops.rope(q, k, positions, self.cos_sin)
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale)
            hidden = layer["o"](attn.view(-1, q_size))
            normed, residual = ops.rms_norm(hidden, layer["post_norm"], cfg.rms_norm_eps, residual)
            gate, up = layer["gate_up"](normed).chunk(2, dim=-1)
            hidden = layer["down"](F.silu(gate) * up)
        last = hidden[logits_rows] + residual[logits_rows]
        normed, _ = ops.rms_norm(last, self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(normed).float()


def _layer_weights(weights: dict[str, torch.Tensor], prefix: str, qkv_bias: bool) -> dict:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    bias = torch.cat([weights[attn + f"{p}_proj.bias"] for p in "qkv"]) if qkv_bias else None
    return {
        "input_norm": weights[prefix + "input_layernorm.weight"],
        "post_norm": weights[prefix + "post_attention_layernorm.weight"],
        "qkv": Linear(torch.cat([weights[attn + f"{p}_proj.weight"] for p in "qkv"]), bias),
        "o": Linear(weights[attn + "o_proj.weight"]),
        "gate_up": Linear(torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]])),
        "down": Linear(weights[mlp + "down_proj.weight"]),
    }


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is no dict
                weights[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return weights
