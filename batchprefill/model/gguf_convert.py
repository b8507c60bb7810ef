"""Convert a llama.cpp GGUF file into an HF-format folder, once, into a cache keyed by the file's hash.

The runtime only ever loads HF folders (config.json, safetensors, tokenizer.json); a GGUF is turned into
one here. Architectures `llama` and `qwen3` convert. llama.cpp stores Llama's Q and K with rows permuted so
that RoPE rotates adjacent pairs; HF's rotate-half layout needs that permutation undone, or the text comes
out silently wrong. Qwen3 runs NeoX-style RoPE in llama.cpp, so its rows are stored as HF has them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CONTROL_TOKEN = 3
# llama.cpp's pre-tokenizer names for byte-level vocabularies: the split their merges were learned on, and
# whether digits are split one by one first.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"smollm": (GPT2_SPLIT, True), "gpt2": (GPT2_SPLIT, False), "default": (GPT2_SPLIT, False),
                  "qwen2": (QWEN2_SPLIT, False)}


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp interleaved Q/K rows for adjacent-pair RoPE


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchprefill" / "models"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_folder(gguf_path: Path) -> Path:
    """The HF folder for this GGUF, converting it first if the cache does not hold it yet."""
    target = cache_root() / f"{gguf_path.stem}-{file_sha256(gguf_path)[:16]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def convert(gguf_path: Path, out_dir: Path) -> None:
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    config = _config(reader, arch)
    tensors = _tensors(reader, config, ARCHITECTURES[arch].permuted_qk)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer, tokenizer_config = _tokenizer(reader)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _config(reader: GGUFReader, arch: str) -> dict:
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    return {
        "architectures": [ARCHITECTURES[arch].hf_architecture],
        "model_type": ARCHITECTURES[arch].model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }


HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _hf_name(name: str) -> str:
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        return f"model.layers.{layer}.{HF_NAMES[kind]}.{suffix}"
    return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[name]


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of RoPE pairs within each head's rows."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensors(reader: GGUFReader, config: dict, permuted_qk: bool) -> dict[str, torch.Tensor]:
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("rope_freqs"):
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = values.reshape([int(d) for d in reversed(tensor.shape.tolist())])
        if permuted_qk and tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, config["num_attention_heads"])
        elif permuted_qk and tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, config["num_key_value_heads"])
        tensors[_hf_name(tensor.name)] = torch.from_numpy(np.array(values, copy=True))
    return tensors


def _strings(reader: GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    assert field.types[-1] == GGUFValueType.STRING
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict]:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    token_types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split, digits = PRE_TOKENIZERS.get(_field(reader, "tokenizer.ggml.pre", "default"), PRE_TOKENIZERS["default"])
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
    if digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {
        "bos_token": tokens[int(_field(reader, "tokenizer.ggml.bos_token_id", 1))],
        "eos_token": tokens[int(_field(reader, "tokenizer.ggml.eos_token_id", 2))],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tokenizer, config
