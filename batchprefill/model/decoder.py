"""The one decoder skeleton every family runs: embed, N x [norm, attention, norm, MLP], norm, head (the LM head, a
score head, or none: model/heads.py).

The forward pass knows nothing of requests or blocks: it gets token ids, positions, the per-layer caches and
attention metadata, and calls a compute backend (`Ops`) for every op that has a kernel. What differs
between families (extra norms, fused projections, MLP kind, windows, RoPE bases, scales) comes from the
config and from the layers its family built (`batchprefill/model/families/`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchprefill.kernels.interface import AttentionMetadata, Ops
from batchprefill.kernels.linear import batch_invariant_linears
from batchprefill.kernels.lora import LoraHook, LoraStep, LoraWeights
from batchprefill.model.config import ModelConfig
from batchprefill.model.families import family_for
from batchprefill.model.families.base import Layer, Weights, norm
from batchprefill.model.heads import LM, SCORE, ScoreHead
from batchprefill.model.lm_head import LMHead
from batchprefill.model.rope import rope_cos_sin


class DecoderModel(torch.nn.Module):
    """Weights held as fused linears (QKV in one matrix, gate and up in one) to halve the op count."""

    def __init__(self, config: ModelConfig, weights: Weights, ops: Ops):
        """Every linear built here (the families' layers, the heads) is batch-invariant where `ops` is."""
        super().__init__()
        with batch_invariant_linears(ops.batch_invariant):
            self._build(config, weights, ops)

    def _build(self, config: ModelConfig, weights: Weights, ops: Ops) -> None:
        self.config = config
        self.ops = ops
        family = family_for(config.architecture)
        self.embed = weights["model.embed_tokens.weight"]
        self.embedding_scale = torch.tensor(config.embedding_scale, dtype=self.embed.dtype, device=self.embed.device)
        self.final_norm = norm(weights, "model.norm.weight", config)
        self.lm_head = LMHead(self.embed if config.tie_word_embeddings else weights["lm_head.weight"],
                              config.final_logit_softcapping) if config.head == LM else None
        self.score_head = ScoreHead(weights) if config.head == SCORE else None
        self.layers: list[Layer] = [family.layer(weights, i, config) for i in range(config.num_layers)]
        self.windows = [config.window(i) for i in range(config.num_layers)]
        self.rotary_dim = config.rotary_dim or config.head_dim
        tables: dict[tuple[float, bool], torch.Tensor] = {}  # one table per RoPE base, shared by its layers
        self.cos_sin = []
        for window in self.windows:
            local = window is not None and config.local_rope_theta is not None
            theta = config.local_rope_theta if local else config.rope_theta
            if (theta, local) not in tables:
                tables[theta, local] = rope_cos_sin(self.rotary_dim, config.max_positions, theta,
                                                    None if local else config.rope_scaling).to(self.embed.device)
            self.cos_sin.append(tables[theta, local])
        self.scale = config.query_scale or config.head_dim**-0.5
        # Per layer, projection -> the LoRA adapters on it (model/adapters.py); empty without model.adapters.
        self.adapters: list[dict[str, LoraWeights]] = []
        self._mlp_lora: list[bool] = []  # per layer: an adapter targets its MLP

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        greedy: bool = False,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Logits `[len(logits_rows), vocab]` for the flat-batch rows that need a next token; with `greedy`, their
        argmax instead (int64 `[len(logits_rows)]`), which on the CPU never makes the full logits (LMHead).
        `lora`: which tokens run which adapter this step (None: all run the base model)."""
        normed = self.final_hidden(input_ids, positions, kv_caches, meta, logits_rows, lora)
        return self.lm_head.greedy_tokens(normed) if greedy else self.lm_head.logits(normed)

    @torch.inference_mode()
    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                     rows: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        """The hidden states after the final norm `[len(rows), hidden]` at the flat-batch `rows`: what a head (or
        an embedding) reads. Only these rows are summed with the residual and normed."""
        cfg, ops = self.config, self.ops
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)
        meta = ops.plan(meta, kv_caches[0][0], cfg.num_heads, hidden.dtype)
        if cfg.embedding_scale != 1.0:
            hidden = hidden * self.embedding_scale
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            hook = self._lora_hook(i, lora)
            normed, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = self._attention(i, layer, normed, positions, k_cache, v_cache, meta, hook)
            if layer.post_attention_norm is not None:
                hidden, _ = ops.rms_norm(hidden, layer.post_attention_norm, eps)
            normed, residual = ops.rms_norm(hidden, layer.pre_mlp_norm, eps, residual)
            hidden = layer.mlp(normed, ops) if hook is None or not self._mlp_lora[i] else layer.mlp(normed, ops, hook)
            if layer.post_mlp_norm is not None:
                hidden, _ = ops.rms_norm(hidden, layer.post_mlp_norm, eps)
        last = hidden[rows] + residual[rows]
        return ops.rms_norm(last, self.final_norm, eps)[0]

    def attach_adapters(self, adapters: list[dict[str, LoraWeights]]) -> None:
        """Hold the job's LoRA adapters (`model.adapters.load_adapters`) for every later forward pass."""
        self.adapters = adapters
        self._mlp_lora = [bool({"gate_up", "down"} & set(layer)) for layer in adapters]

    def _lora_hook(self, i: int, step: LoraStep | None) -> LoraHook | None:
        """What layer i's projections call to add their adapters' deltas this step; None when nothing to add."""
        if step is None or not self.adapters or not self.adapters[i]:
            return None
        projections, lora = self.adapters[i], self.ops.lora

        def hook(slot: str, out: torch.Tensor, x: torch.Tensor) -> None:
            weights = projections.get(slot)
            if weights is not None:
                lora(out, x, weights, step)

        return hook

    def _attention(self, i: int, layer: Layer, normed: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   hook: LoraHook | None = None) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        q_size, kv_size, head_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        qkv = layer.qkv(normed)
        if hook is not None:
            hook("qkv", qkv, normed)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, head_dim)
        k = k.view(-1, cfg.num_kv_heads, head_dim)
        v = v.view(-1, cfg.num_kv_heads, head_dim)
        if layer.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, head_dim), layer.q_norm, cfg.rms_norm_eps)[0].view_as(q)
            k = ops.rms_norm(k.reshape(-1, head_dim), layer.k_norm, cfg.rms_norm_eps)[0].view_as(k)
        if self.rotary_dim < head_dim:  # partial rotary: the rest of each head passes through
            q_rot, k_rot = ops.rope(q[..., : self.rotary_dim], k[..., : self.rotary_dim], positions, self.cos_sin[i])
            q = torch.cat([q_rot, q[..., self.rotary_dim :]], dim=-1)
            k = torch.cat([k_rot, k[..., self.rotary_dim :]], dim=-1)
        else:
            q, k = ops.rope(q, k, positions, self.cos_sin[i])
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = ops.attention(q, k_cache, v_cache, meta, self.scale, self.windows[i]).view(-1, q_size)
        out = layer.o(attn)
        if hook is not None:
            hook("o", out, attn)
        return out
