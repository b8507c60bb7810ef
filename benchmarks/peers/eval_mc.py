"""Multiple choice, 5-shot, 4 choices, several subjects (a few-shot header per subject), side by side in one run:
batchprefill-eval, lm-eval's `hf` backend, and vLLM's CPU build called as lm-eval's vllm backend calls it.

    python benchmarks/peers/eval_mc.py --subjects 8 --questions 64 --out benchmarks/results/eval_mc.json  # 8 x 64 = 512
    python benchmarks/peers/eval_mc.py --subjects 2 --questions 8 --skip-vllm                       # a quick look

Every engine gets the same model folder (the shipped SmolLM2-135M, float32, CPU) and the same tasks: one lm-eval
task per subject, written here as local YAMLs over JSONL (`--include_path`), the first 5 questions of a subject
its shots (`fewshot_config: sampler: first_n`). vLLM gets the (context, continuation) token ids lm-eval's
tokenization gives, one request each, `prompt_logprobs=1`, `max_tokens=1`; its own counters say what it cached.
Prompt tokens: `ideal` is each distinct context once plus every choice's tokens; batchprefill reports what its
engine computed (a choice's last token needs no KV, and headers are shared across a subject's contexts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
WORDS = ["river", "mountain", "city", "planet", "engine", "number", "colour", "animal", "metal", "forest", "ocean",
         "language", "instrument", "theory", "signal", "market", "vessel", "harvest", "lantern", "border", "mirror",
         "season", "factor", "window", "chapter"]
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {data}
    test: {data}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
fewshot_config:
  sampler: first_n
description: "The following are multiple choice questions about {subject}.\\n\\n"
doc_to_text: "{{{{question}}}}{{% for c in choices %}}\\n{{{{'ABCD'[loop.index0]}}}}. {{{{c}}}}{{% endfor %}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_tasks(folder: Path, subjects: int, questions: int, seed: int) -> list[str]:
    """One task per subject; `questions` test questions each, after 5 shots."""
    rng = random.Random(seed)
    names = []
    for s in range(subjects):
        subject = f"subject {WORDS[s % len(WORDS)]} {s}"
        rows = []
        for _ in range(questions + 5):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(12, 30)))
            rows.append({"question": f"Which {rng.choice(WORDS)} fits: {words}?",
                         "choices": [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 5)))
                                     for _ in range(4)], "answer": rng.randrange(4)})
        data = folder / f"mc_{s}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        name = f"bench_mc_{s}"
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data, subject=subject))
        names.append(name)
    return names


def run_lm_eval(module: str, model: str, model_args: str, tasks: list[str], folder: Path, out: Path,
                limit: int) -> tuple[float, dict, str]:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", module, "--model", model, "--model_args", model_args, "--tasks",
               ",".join(tasks), "--include_path", str(folder), "--output_path", str(out), "--device", "cpu",
               "--batch_size", "16", "--limit", str(limit)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{module} failed: {done.stderr[-2000:]}")
    (path,) = out.rglob("results_*.json")
    return wall, json.loads(path.read_text())["results"], done.stderr


def loglikelihood_pairs(folder: Path, tasks: list[str], limit: int, model_folder: Path) -> list:
    """The (context, continuation) token ids lm-eval's `hf` backend would score, from lm-eval's own task code."""
    from lm_eval.tasks import TaskManager, get_task_dict
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    pairs = []
    for task in get_task_dict(tasks, TaskManager(include_path=str(folder))).values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        for instance in task.instances:
            context, continuation = instance.args
            spaces = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - spaces], context[len(context) - spaces:] + continuation
            whole, alone = encode(context + continuation), encode(context)
            pairs.append([alone, whole[len(alone):]])
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", type=int, default=8)
    parser.add_argument("--questions", type=int, default=64, help="test questions per subject (after 5 shots)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-eval-mc"))
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from batchprefill.model.loader import resolve_folder

    model_folder = resolve_folder(None)
    args.work.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(args.work, args.subjects, args.questions, args.seed)
    limit = args.questions + 5  # lm-eval's --limit counts test docs; the shots are docs of the same file
    pairs = loglikelihood_pairs(args.work, tasks, limit, model_folder)
    contexts = {tuple(c) for c, _ in pairs}
    ideal = sum(map(len, contexts)) + sum(len(x) for _, x in pairs)
    report: dict = {"questions": len(pairs) // 4, "requests": len(pairs), "ideal_prompt_tokens": ideal,
                    "prompt_tokens_without_reuse": sum(len(c) + len(x) for c, x in pairs)}
    model_args = f"pretrained={model_folder},dtype=float32"
    wall, results, log = run_lm_eval("batchprefill.cli.eval", "batchprefill", model_args, tasks, args.work,
                                     args.work / "out-bp", limit)
    computed = int(re.search(r"loglikelihood: \d+ requests, \d+ prompt tokens, (\d+) computed", log).group(1))
    report["batchprefill"] = {"process_seconds": wall, "computed_prompt_tokens": computed,
                              "computed_over_ideal": computed / ideal,
                              "acc": {t: results[t]["acc,none"] for t in tasks}}
    print(json.dumps(report), file=sys.stderr, flush=True)
    if not args.skip_hf:
        wall, results, _ = run_lm_eval("lm_eval", "hf", model_args, tasks, args.work, args.work / "out-hf", limit)
        report["hf"] = {"process_seconds": wall, "acc": {t: results[t]["acc,none"] for t in tasks}}
    if not args.skip_vllm:
        requests = args.work / "vllm_requests.json"
        requests.write_text(json.dumps(pairs))
        start = time.perf_counter()
        done = subprocess.run([str(args.vllm_python), str(HERE / "peer_vllm_loglik.py"), "--requests", str(requests),
                               "--model", str(model_folder), "--pool-tokens", "65536"],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"vllm failed: {done.stderr[-2000:]}")
        # vLLM logs to stdout too: the figures are the one line that is a JSON object with an "engine" key
        vllm = next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"engine"'))
        vllm.pop("loglikelihoods")
        report["vllm"] = {**vllm, "total_seconds": time.perf_counter() - start}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
