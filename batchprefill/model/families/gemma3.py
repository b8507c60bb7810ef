"""Gemma 3 (text, `Gemma3ForCausalLM`): (1 + w) RMSNorms, norms before and after both attention and MLP,
q/k norms, embeddings scaled by sqrt(hidden), `query_pre_attn_scalar`, a GELU-tanh gated MLP, sliding and
full layers (`layer_types` or the older `sliding_window_pattern`) with their own RoPE base, and optional
final logit soft-capping."""

from __future__ import annotations

from batchprefill.kernels.linear import Linear
from batchprefill.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, base_fields, rope_parameters
from batchprefill.model.families.base import Family, Layer, Weights, norm, separate_gate_up, separate_qkv


def config(raw: dict, architecture: str) -> ModelConfig:
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    local = rope_parameters(raw, SLIDING_ATTENTION) if SLIDING_ATTENTION in (raw.get("rope_parameters") or {}) else {
        "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported")
    fields = base_fields({**raw, "rope_parameters": rope_parameters(raw, FULL_ATTENTION)}, architecture)
    fields.update(tie_word_embeddings=raw.get("tie_word_embeddings", True),
                  hidden_act=raw.get("hidden_activation", "gelu_pytorch_tanh"))
    return ModelConfig(
        **fields,
        local_rope_theta=float(local["rope_theta"]),
        query_scale=float(raw.get("query_pre_attn_scalar", fields["head_dim"])) ** -0.5,
        embedding_scale=raw["hidden_size"] ** 0.5,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        norm_offset=1.0,
        qk_norm=True,
    )


def layer(weights: Weights, index: int, config: ModelConfig) -> Layer:
    """Gemma's `post_attention_layernorm` is on the attention output; `pre_feedforward_layernorm` feeds the MLP."""
    prefix = f"model.layers.{index}."
    attn = prefix + "self_attn."
    return Layer(
        input_norm=norm(weights, prefix + "input_layernorm.weight", config),
        qkv=separate_qkv(weights, prefix, config),
        o=Linear(weights[attn + "o_proj.weight"]),
        pre_mlp_norm=norm(weights, prefix + "pre_feedforward_layernorm.weight", config),
        mlp=separate_gate_up(weights, prefix, config),
        q_norm=norm(weights, attn + "q_norm.weight", config),
        k_norm=norm(weights, attn + "k_norm.weight", config),
        post_attention_norm=norm(weights, prefix + "post_attention_layernorm.weight", config),
        post_mlp_norm=norm(weights, prefix + "post_feedforward_layernorm.weight", config),
    )


FAMILY = Family("gemma3", ("Gemma3ForCausalLM",), config, layer)
