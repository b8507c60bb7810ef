"""n = 8 samples of 32 tokens per prompt on the shared-prefix workload: batchprefill (sampling.n, one fork per
sample after the prompt) against vLLM's CPU build with SamplingParams(n=8), side by side in one run.

    python benchmarks/peers/samples_n.py --out benchmarks/results/samples_n.json
    python benchmarks/peers/samples_n.py --rows 8                          # a quick look

Both sample at temperature 1 with `ignore_eos` (every sample is 32 tokens), float32, the same token ids, the same
KV pool and step budget (benchmarks/peers/compare.py's settings); samples differ between engines (different streams).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

import compare  # noqa: E402
import workloads as wl  # noqa: E402

SAMPLES, TOKENS, POOL = 8, 32, 65536


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help="keep only the first ROWS prompts")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-bench-samples"))
    parser.add_argument("--vllm-python", default=str(wl.VLLM_PYTHON))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    workload = wl.shared_prefix()
    workload.prompts = workload.prompts[: args.rows]
    path = workload.write(args.work)
    ours = compare.run_batchprefill(path, args.work, "samples", TOKENS, POOL, args, **{
        "sampling.n": SAMPLES, "sampling.temperature": 1.0})
    theirs = compare.run_peer("peer_vllm.py", args.vllm_python, path, args.work, "vllm-samples", [
        "--max-tokens", str(TOKENS), "--pool-tokens", str(POOL), "--n", str(SAMPLES),
        "--max-batched-tokens", str(args.max_batched_tokens)])
    keep = ("wall_seconds", "generate_seconds", "prompt_tokens", "cached_tokens", "computed_prompt_tokens",
            "output_tokens", "output_tokens_per_second")
    report = {"prompts": len(workload.prompts), "samples": SAMPLES, "max_tokens": TOKENS,
              "batchprefill": {k: ours[k] for k in keep}, "vllm": {k: theirs.get(k) for k in keep}}
    report["speedup"] = theirs["wall_seconds"] / ours["generate_seconds"]  # both: the engine loop alone
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
