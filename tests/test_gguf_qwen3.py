"""A qwen3 GGUF, written with the gguf library from a random transformers Qwen3, converts and runs as the
original model does; its `qwen2` pre-tokenizer tokenizes as transformers reads the same GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFWriter, TokenType

from batchprefill.errors import JobError
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.loader import load_model, resolve_folder
from batchprefill.model.tokenizer import PromptTokenizer
from tests.test_numerics import prefill_logits

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]


VOCAB = 2000  # a prefix of SmolLM2's vocabulary: conversion and transformers' GGUF reader stay fast


def small_vocabulary(tokenizer_json: dict, size: int) -> dict:
    """The first `size` tokens of a byte-level BPE vocabulary and the merges among them: still a whole
    tokenizer (every byte is in it), whose ids are the original ones."""
    vocab = {token: i for token, i in tokenizer_json["model"]["vocab"].items() if i < size}
    merges = [m for m in tokenizer_json["model"]["merges"] if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    added = [t for t in tokenizer_json["added_tokens"] if t["id"] < size]
    return {**tokenizer_json, "model": {**tokenizer_json["model"], "vocab": vocab, "merges": merges},
            "added_tokens": added}


def write_qwen3_gguf(model: transformers.PreTrainedModel, tokenizer_json: dict, path) -> None:
    """What llama.cpp's converter writes for Qwen3 (NeoX RoPE: Q and K rows kept as HF has them), in float32."""
    cfg = model.config
    writer = GGUFWriter(str(path), "qwen3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tokenizer_json["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied
            writer.add_tensor(gguf_name(name), tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_random_qwen3_gguf_converts_to_the_same_logits_and_tokens(tmp_path, model_folder, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      rope_theta=20000.0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if "norm" in name:  # q/k norms away from 1, so a dropped one shows
                weight.add_(0.3 * torch.randn_like(weight))
    gguf_path = tmp_path / "tiny-qwen3.gguf"
    tokenizer_json = small_vocabulary(json.loads((model_folder / "tokenizer.json").read_text()), VOCAB)
    write_qwen3_gguf(reference, tokenizer_json, gguf_path)

    folder = resolve_folder(str(gguf_path))
    loaded = load_model(folder, torch.float32, torch.device("cpu"), TorchOps())
    assert loaded.model.config.architecture == "Qwen3ForCausalLM" and loaded.model.config.qk_norm
    ids = torch.randint(3, VOCAB, (33,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    ours = prefill_logits(loaded.model, ids, chunk=10, block_size=4)
    assert (ours - theirs).abs().max().item() < 1e-4

    text = "In 2026, 12345 bees\n\n  made $honey: 'tis sweet!"  # digits, newlines, "$honey": qwen2 splits apart
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    ours_ids = PromptTokenizer(folder).encode_batch([text])[0]
    assert ours_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert PromptTokenizer(folder).decode(ours_ids) == text


def test_a_gemma3_gguf_fails_with_one_line_naming_the_architectures_that_convert(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(JobError, match="'gemma3' is not supported; supported: llama, qwen3"):
        resolve_folder(str(path))
