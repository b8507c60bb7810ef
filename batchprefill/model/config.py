"""A model's shape and the options in which its family differs from Llama, read from an HF `config.json`.

The fields' defaults are Llama's; a family's parser (`batchprefill/model/families/`) sets only what differs.
A family that needs more (mixture-of-experts sizes) subclasses `ModelConfig` and adds fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchprefill.model.quantization import Quantization

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


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
    rope_scaling: dict | None  # rope_type llama3, linear or longrope and its parameters; None = plain RoPE
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    # Where families differ from Llama:
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding-window width in tokens, None = full; () = all full
    local_rope_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3); None = rope_theta
    rotary_dim: int | None = None  # RoPE rotates only the first rotary_dim dims of a head (Phi-4-mini); None = all
    query_scale: float | None = None  # attention scale; None = head_dim ** -0.5
    embedding_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): 1 in Gemma
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh
    # What the folder has on the final norm (model/heads.py): "lm" (causal LM), "none" (a base model's hidden
    # states only) or "score" (sequence classification, `num_labels` outputs).
    head: str = "lm"
    num_labels: int = 0
    quantization: Quantization | None = None  # the checkpoint's (model/quantization.py); None: 16- or 32-bit

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer: its queries see their last `window` positions, themselves included."""
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_element)

    def num_parameters(self) -> int:
        """Parameters in the linear layers and the LM head: the N of the 2·tokens·N FLOP estimate."""
        return self.dense_linear_parameters() + self.vocab_size * self.hidden_size

    def attention_parameters(self) -> int:
        """One layer's Q, K, V and O projections."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size

    def dense_linear_parameters(self) -> int:
        """The decoder layers' dense linears (attention and gated MLPs): what an FP8 model holds in one byte each."""
        return self.num_layers * (self.attention_parameters() + 3 * self.hidden_size * self.intermediate_size)

    def expert_parameters(self) -> int:
        """A mixture-of-experts model's routed experts' projections: what an FP8 checkpoint's hold in one byte each
        on a GPU (none here: a dense model)."""
        return 0

    def other_parameters(self) -> int:
        """What a model stores beside its dense linears and experts, in the compute dtype: the embedding, an untied
        LM head or a score head, and a mixture-of-experts model's routers (norms, a few thousand, are left out)."""
        heads = {"lm": 0 if self.tie_word_embeddings else self.vocab_size, "score": self.num_labels, "none": 0}
        return (self.vocab_size + heads[self.head]) * self.hidden_size


def rope_parameters(raw: dict, layer_type: str | None = None) -> dict:
    """RoPE settings as one flat dict with `rope_theta` and, when scaled, `rope_type` and its parameters.

    transformers 5.x nests them under `rope_parameters` (by layer type for Gemma 3); older files keep
    `rope_theta`, `rope_scaling` and `partial_rotary_factor` at the top level. Both layouts are read.
    """
    nested = raw.get("rope_parameters") or {}
    if layer_type is not None and isinstance(nested.get(layer_type), dict):
        nested = nested[layer_type]
    elif any(isinstance(value, dict) for value in nested.values()):
        nested = {}
    flat = {**(raw.get("rope_scaling") or {}), **nested}
    flat.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if raw.get("partial_rotary_factor") is not None:
        flat.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if "type" in flat:
        flat.setdefault("rope_type", flat.pop("type"))
    if flat.get("rope_type") in ("longrope", "llama3") and raw.get("original_max_position_embeddings"):
        flat["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3 keeps it outside
    return flat


def rope_scaling(params: dict) -> dict | None:
    """The scaling part of `rope_parameters`: None for plain RoPE."""
    if params.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}


def layer_windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `sliding_window` and `layer_types` (or the older flags that imply them)."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return ()
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw:  # Qwen2/Qwen3 files before layer_types
        types = [SLIDING_ATTENTION if i >= raw["max_window_layers"] else FULL_ATTENTION for i in range(num_layers)]
    if types is None and raw.get("sliding_window_pattern"):  # Gemma 3 files before layer_types
        pattern = int(raw["sliding_window_pattern"])
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    windows = tuple(int(window) if kind == SLIDING_ATTENTION else None for kind in types)
    return windows if any(windows) else ()


def base_fields(raw: dict, architecture: str, default_qkv_bias: bool = False) -> dict:
    """The Llama-shaped fields every family shares, as ModelConfig keyword arguments."""
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rope = rope_parameters(raw)
    factor = float(rope.get("partial_rotary_factor", 1.0))
    eos = raw.get("eos_token_id", 2)
    return dict(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope_scaling(rope),
        max_positions=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=raw.get("attention_bias", default_qkv_bias),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,),
        layer_windows=layer_windows(raw, raw["num_hidden_layers"]),
        rotary_dim=int(head_dim * factor) if factor < 1.0 else None,
        hidden_act=raw.get("hidden_act", "silu"),
    )
