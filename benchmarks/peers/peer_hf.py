"""Run one workload through HF transformers `generate`, in batches of 8 with left padding, in input order.

    python benchmarks/peers/peer_hf.py --input w.parquet --model FOLDER --max-tokens 16 --threads 2

This is the plain baseline a user writes first: no prefix reuse, padding to the longest prompt of each
batch. Prompts are tokenized with the folder's tokenizer.json without special tokens, as batchprefill does.
Generation ignores EOS (no EOS id in the generation config), like the other engines, so every row yields
exactly max-tokens tokens. Prints one JSON line; writes every row's output token ids to --outputs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--outputs", type=Path)
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    table = pq.read_table(args.input, columns=["id", "prompt"]).to_pydict()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = [e.ids for e in tokenizer.encode_batch(table["prompt"], add_special_tokens=False)]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    ready = time.perf_counter()

    outputs: list[list[int]] = []
    padded = 0  # prompt positions computed, padding included
    with torch.inference_mode():
        for first in range(0, len(prompts), args.batch_size):
            batch = prompts[first : first + args.batch_size]
            width = max(len(p) for p in batch)
            padded += width * len(batch)
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            generated = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            outputs.extend(generated[:, width:].tolist())
    done = time.perf_counter()

    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o) for o in outputs)
    if args.outputs:
        args.outputs.write_text(json.dumps(dict(zip(table["id"], outputs))))
    print(json.dumps({
        "engine": "hf-transformers", "block_size": None, "wall_seconds": done - ready, "total_seconds": done - start,
        "startup_seconds": ready - start, "prompt_tokens": prompt_tokens, "cached_tokens": 0,
        "computed_prompt_tokens": padded, "output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / (done - ready), "cache_hit_rate": 0.0,
        "preemptions": 0,
    }), flush=True)


if __name__ == "__main__":
    main()
