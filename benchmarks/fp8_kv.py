"""FP8 KV (engine.kv_cache_dtype) against the model dtype's own KV on the shipped model: how often task=score picks
the same best choice, and how long greedy answers stay the same.

    python benchmarks/fp8_kv.py                          # fp8 (e4m3) against auto, model.dtype=auto
    python benchmarks/fp8_kv.py --kv-cache-dtype fp8_e5m2 --prompts 16 --tokens 64

Score rows: the shipped sample's 48 prompts (data_samples/prompts.parquet), each scored twice, against the four
documents' subjects (" Paris", " honey bees", " Mount Etna", " the James Webb Space Telescope") and against four
one-sentence answers, 96 rows of 4 choices. Greedy rows: the first `--prompts` sample prompts in the chat template,
`--tokens` tokens each, EOS ignored, so every row has as many tokens to compare.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

import batchprefill

REPO = Path(__file__).resolve().parents[1]
SUBJECTS = [" Paris", " honey bees", " Mount Etna", " the James Webb Space Telescope"]
ANSWERS = [" It is about a city and its famous buildings.", " It is about insects that make honey.",
           " It is about a volcano in Italy.", " It is about a telescope in space."]


def score_rows() -> pl.DataFrame:
    prompts = pl.read_parquet(REPO / "data_samples" / "prompts.parquet").filter(pl.col("topic") != "bad-input")
    return pl.concat([prompts.select("id", "prompt").with_columns(pl.col("id") + suffix, choices=pl.lit(choices))
                      for suffix, choices in (("-subject", SUBJECTS), ("-answer", ANSWERS))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--dtype", default="auto", help="model.dtype")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    scored = score_rows()
    greedy = pl.read_parquet(REPO / "data_samples" / "prompts.parquet").filter(
        pl.col("topic") != "bad-input").head(args.prompts).select("id", "prompt")
    results = {}
    for kv in ("auto", args.kv_cache_dtype):
        runner = batchprefill.Runner(progress=False, **{"model.dtype": args.dtype, "engine.kv_cache_dtype": kv,
                                                        "output.plot": False})
        results[kv] = (
            runner.run(scored, task="score").table.sort("id"),
            runner.run(greedy, **{"data.chat_template": True, "sampling.max_tokens": args.tokens,
                                  "sampling.ignore_eos": True}).table.sort("id"))
    (base_score, base_text), (fp8_score, fp8_text) = results["auto"], results[args.kv_cache_dtype]
    same_best = int((base_score["best_choice"] == fp8_score["best_choice"]).sum())
    logprob_gap = max(abs(a - b) for x, y in zip(base_score["choice_logprobs"], fp8_score["choice_logprobs"])
                      for a, b in zip(x, y))
    common = []
    for a, b in zip(base_text["output_token_ids"], fp8_text["output_token_ids"]):
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        common.append(first_difference)
    report = {
        "model_dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "score_rows": len(base_score), "score_same_best": same_best,
        "score_agreement": round(same_best / len(base_score), 4),
        "score_largest_logprob_difference": round(logprob_gap, 4),
        "greedy_rows": len(common), "greedy_tokens": args.tokens,
        "greedy_rows_identical": sum(n == args.tokens for n in common),
        "greedy_mean_tokens_before_first_difference": round(sum(common) / len(common), 1),
        "greedy_tokens_before_first_difference": common,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
