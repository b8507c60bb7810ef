"""A random-weight model folder of a larger shape, for benchmarks where compute per token grows.

    python benchmarks/random_model.py --out /tmp/qwen2.5-0.5b-shape       # Qwen2.5-0.5B's shapes, bfloat16

Qwen2.5-0.5B's architecture (hidden 896, 24 layers, 14 query and 2 KV heads of 64, intermediate 4864, tied
embeddings, RoPE base 1e6) with weights drawn at random by transformers, and the shipped SmolLM2 tokenizer's
vocabulary (49152), so both engines read the same prompt token ids as for the shipped model. The weights carry no
knowledge: outputs are noise, which a benchmark with `ignore_eos` does not mind (every row yields max_tokens).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import transformers

    from batchprefill.model.loader import resolve_folder

    shipped = resolve_folder(None)
    config = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype=args.dtype)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (shipped / name).exists():
            shutil.copy(shipped / name, args.out / name)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
