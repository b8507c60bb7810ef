"""Multiple choice, 5-shot, 4 choices, several subjects (a few-shot header per subject), side by side in one run:
batchprefill-eval, lm-eval's `hf` backend, and vLLM's CPU build called as lm-eval's vllm backend calls it.

    python benchmarks/peers/eval_mc.py --subjects 8 --questions 64 --out benchmarks/results/eval_mc.json  # 8 x 64 = 512
    python benchmarks/peers/eval_mc.py --subjects 2 --questions 8 --skip-vllm                       # a quick look
    python benchmarks/peers/eval_mc.py --dtype bfloat16 --kv-cache-dtypes auto,fp8,fp8_e5m2 --skip-hf --skip-vllm
    python benchmarks/peers/eval_mc.py --kind facts --kv-cache-dtypes auto,fp8 --skip-hf --skip-vllm  # above chance

Every engine gets the same model folder (the shipped SmolLM2-135M, `--dtype`, CPU) and the same tasks: one lm-eval
task per subject, written here as local YAMLs over JSONL (`--include_path`), the first 5 questions of a subject
its shots (`fewshot_config: sampler: first_n`). `--kind words` (the default): random words, four lettered
choices, the model at chance; `--kind facts`: `mc_facts.py`'s questions the model answers above chance, each choice's
own text the continuation (as lm-eval's ARC), so `acc_norm` is reported too. vLLM gets the (context, continuation)
token ids lm-eval's tokenization gives, one request each, `prompt_logprobs=1`, `max_tokens=1`; its own counters say
what it cached. Prompt tokens: `ideal` is each distinct context once plus every choice's tokens; batchprefill reports
what its engine computed (a choice's last token needs no KV, and headers are shared across a subject's contexts).

`--kv-cache-dtypes A,B,...`: batchprefill-eval once per KV cache dtype (`engine.kv_cache_dtype` in --model_args), and
a table of every lm-eval metric per task and over all questions, each KV dtype's beside the first's with the
difference in points (issue 40's goal: FP8 KV within 1 point of the model dtype's KV), and how many questions keep
the first's pick (its highest-scoring choice) with the largest change of a log-likelihood (lm-eval's samples).
Unless `--skip-vllm`, vLLM runs the same pairs once per KV dtype too (its own `kv_cache_dtype` names), and its `acc`
is computed from its log-likelihoods as lm-eval would (the highest choice against the document's target).
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
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/: workloads

from mc_facts import SUBJECTS, questions  # noqa: E402
from workloads import VLLM_PYTHON, cpu_model  # noqa: E402

WORDS = ["river", "mountain", "city", "planet", "engine", "number", "colour", "animal", "metal", "forest", "ocean",
         "language", "instrument", "theory", "signal", "market", "vessel", "harvest", "lantern", "border", "mirror",
         "season", "factor", "window", "chapter"]
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {shots}
    test: {data}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
fewshot_config:
  sampler: first_n
description: "{description}\\n\\n"
{format}"""
# the words kind: four lettered choices after the question; the facts kind: each choice's own text (as ARC)
LETTERED = """doc_to_text: "{{question}}{% for c in choices %}\\n{{'ABCD'[loop.index0]}}. {{c}}{% endfor %}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""
CLOZE = """doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_tasks(folder: Path, subjects: int, questions: int, seed: int, kind: str = "words") -> list[str]:
    """One task per subject; `questions` test questions each, after 5 shots."""
    if kind == "facts":
        return write_fact_tasks(folder, subjects, questions, seed)
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
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(
            name=name, shots=data, data=data, format=LETTERED,
            description=f"The following are multiple choice questions about {subject}."))
        names.append(name)
    return names


def write_fact_tasks(folder: Path, subjects: int, count: int, seed: int) -> list[str]:
    """`mc_facts.py`'s first `subjects` subjects as tasks: 5 shots in one file, `count` other questions in another
    (the words kind's single file puts its shots among the test questions, each shot scored with its own answer in
    its context)."""
    if subjects > len(SUBJECTS):
        raise SystemExit(f"--kind facts has {len(SUBJECTS)} subjects; ask for at most that many")
    names = []
    for s, subject in enumerate(list(SUBJECTS)[:subjects]):
        rows = [json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                for q, c, a in questions(subject, count + 5, seed + s)]
        shots, tests = folder / f"facts_{s}_shots.jsonl", folder / f"facts_{s}.jsonl"
        shots.write_text("".join(rows[:5]))
        tests.write_text("".join(rows[5:]))
        name = f"bench_facts_{s}"
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(
            name=name, shots=shots, data=tests, format=CLOZE,
            description=f"The following are questions about {subject}."))
        names.append(name)
    return names


def run_lm_eval(module: str, model: str, model_args: str, tasks: list[str], folder: Path, out: Path,
                limit: int) -> tuple[float, dict, str]:
    """lm-eval's process seconds, results and stderr; each request's scores are kept in `out` (--log_samples)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", module, "--model", model, "--model_args", model_args, "--tasks",
               ",".join(tasks), "--include_path", str(folder), "--output_path", str(out), "--device", "cpu",
               "--batch_size", "16", "--limit", str(limit), "--log_samples"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{module} failed: {done.stderr[-2000:]}")
    (path,) = out.rglob("results_*.json")
    return wall, json.loads(path.read_text())["results"], done.stderr


def metrics(results: dict, tasks: list[str]) -> dict[str, dict[str, float]]:
    """task -> lm-eval metric ("acc,none") -> value, leaving out the standard errors."""
    return {t: {k: v for k, v in results[t].items() if "," in k and "_stderr" not in k} for t in tasks}


def choice_scores(out: Path, tasks: list[str]) -> dict[tuple[str, int], list[float]]:
    """(task, doc_id) -> each choice's log-likelihood, from lm-eval's samples_<task>_*.jsonl."""
    scores = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            scores[task, sample["doc_id"]] = [float(r[0][0]) for r in sample["resps"]]
    return scores


def kv_comparison(runs: dict[str, dict], tasks: list[str]) -> str:
    """A Markdown table: every metric per task and over all tasks (the mean: every task has as many questions),
    each KV dtype beside the first with the difference in points, then the picks kept and the largest change."""
    kinds = list(runs)
    base = kinds[0]
    names = sorted({m for t in tasks for m in runs[base]["metrics"][t]})
    head = " | ".join(f"{kv} | {kv} - {base} (points)" for kv in kinds[1:])
    lines = [f"| task | metric | {base} | {head} |", "| --- | --- | ---: |" + " ---: | ---: |" * (len(kinds) - 1)]
    for task in [*tasks, "all"]:
        for name in names:
            value = {kv: sum(runs[kv]["metrics"][t][name] for t in tasks) / len(tasks) if task == "all"
                     else runs[kv]["metrics"][task][name] for kv in kinds}
            cells = " | ".join(f"{value[kv]:.4f} | {100 * (value[kv] - value[base]):+.2f}" for kv in kinds[1:])
            lines.append(f"| {task} | {name} | {value[base]:.4f} | {cells} |")
    for kv in kinds[1:]:
        same, largest = runs[kv]["same_pick"], runs[kv]["largest_change"]
        lines.append(f"\n{kv}: {same[0]} of {same[1]} questions keep {base}'s pick ({same[0] / same[1]:.1%}); "
                     f"the largest change of a log-likelihood is {largest:.4f}")
    return "\n".join(lines)


def loglikelihood_pairs(folder: Path, tasks: list[str], limit: int, model_folder: Path) -> tuple[list, list]:
    """The (context, continuation) token ids lm-eval's `hf` backend would score, from lm-eval's own task code, and
    each pair's (task, document, choice, the document's right choice), to score another engine's log-likelihoods."""
    from lm_eval.tasks import TaskManager, get_task_dict
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    pairs, keys = [], []
    for name, task in get_task_dict(tasks, TaskManager(include_path=str(folder))).items():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        for instance in task.instances:
            context, continuation = instance.args
            spaces = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - spaces], context[len(context) - spaces:] + continuation
            whole, alone = encode(context + continuation), encode(context)
            pairs.append([alone, whole[len(alone):]])
            keys.append((name, instance.doc_id, instance.idx, task.doc_to_target(instance.doc)))
    return pairs, keys


def accuracy(loglikelihoods: list[float], keys: list[tuple], tasks: list[str]) -> dict[str, float]:
    """lm-eval's `acc` from another engine's log-likelihoods: per task, the share of documents whose highest choice
    is the right one; "all" is the mean over tasks (each has as many questions)."""
    best: dict[tuple[str, int], tuple[float, int, int]] = {}
    for value, (task, doc, choice, target) in zip(loglikelihoods, keys, strict=True):
        if (task, doc) not in best or value > best[task, doc][0]:
            best[task, doc] = (value, choice, target)
    acc = {t: sum(c == r for (task, _), (_, c, r) in best.items() if task == t)
           / sum(task == t for task, _ in best) for t in tasks}
    return {**acc, "all": sum(acc.values()) / len(acc)}


def run_vllm(args: argparse.Namespace, requests: Path, model_folder: Path, kv: str) -> dict:
    """vLLM's CPU build over the same pairs with its `kv_cache_dtype`; its figures and log-likelihoods."""
    start = time.perf_counter()
    done = subprocess.run([str(args.vllm_python), str(HERE / "peer_vllm_loglik.py"), "--requests", str(requests),
                           "--model", str(model_folder), "--pool-tokens", "65536", "--dtype", args.dtype,
                           "--kv-cache-dtype", kv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"vllm failed: {done.stderr[-2000:]}")
    # vLLM logs to stdout too: the figures are the one line that is a JSON object with an "engine" key
    vllm = next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"engine"'))
    return {**vllm, "total_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", type=int, default=8)
    parser.add_argument("--questions", type=int, default=64, help="test questions per subject (after 5 shots)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", default="words", choices=["words", "facts"],
                        help="random words (the model at chance) or mc_facts.py's questions (above chance)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-eval-mc"))
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every engine's")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="batchprefill-eval once per engine.kv_cache_dtype (comma list), each against the first")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from batchprefill.model.loader import resolve_folder

    model_folder = resolve_folder(None)
    args.work.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(args.work, args.subjects, args.questions, args.seed, args.kind)
    limit = args.questions + 5  # lm-eval's --limit counts test docs; the shots are docs of the same file
    pairs, keys = loglikelihood_pairs(args.work, tasks, limit, model_folder)
    contexts = {tuple(c) for c, _ in pairs}
    ideal = sum(map(len, contexts)) + sum(len(x) for _, x in pairs)
    report: dict = {"kind": args.kind, "questions": len(pairs) // 4, "requests": len(pairs),
                    "ideal_prompt_tokens": ideal, "prompt_tokens_without_reuse": sum(len(c) + len(x) for c, x in pairs)}
    model_args = f"pretrained={model_folder},dtype={args.dtype}"
    runs: dict[str, dict] = {}
    for kv in args.kv_cache_dtypes.split(","):
        out = args.work / f"out-bp-{kv}"
        wall, results, log = run_lm_eval("batchprefill.cli.eval", "batchprefill",
                                         f"{model_args},engine.kv_cache_dtype={kv}", tasks, args.work, out, limit)
        computed = int(re.search(r"loglikelihood: \d+ requests, \d+ prompt tokens, (\d+) computed", log).group(1))
        runs[kv] = {"process_seconds": wall, "computed_prompt_tokens": computed,
                    "computed_over_ideal": computed / ideal,
                    "kv_pool": re.search(r"a KV pool of [^;\n]*", log).group(0), "metrics": metrics(results, tasks),
                    "acc": {t: results[t]["acc,none"] for t in tasks}, "scores": choice_scores(out, tasks)}
        print(f"{kv}: {wall:.1f} s, {runs[kv]['kv_pool']}", file=sys.stderr, flush=True)
    base = runs[next(iter(runs))].pop("scores")
    for kv in list(runs)[1:]:
        scores = runs[kv].pop("scores")
        picks = [max(range(len(s)), key=s.__getitem__) == max(range(len(s)), key=base[key].__getitem__)
                 for key, s in scores.items()]
        runs[kv]["same_pick"] = [sum(picks), len(picks)]
        runs[kv]["largest_change"] = max(abs(a - b) for key, s in scores.items() for a, b in zip(s, base[key]))
    report["dtype"], report["cpu"] = args.dtype, cpu_model()
    report["batchprefill"] = runs[next(iter(runs))]
    if len(runs) > 1:
        report["kv_cache_dtypes"] = runs
        print(kv_comparison(runs, tasks), flush=True)
    if not args.skip_hf:
        wall, results, _ = run_lm_eval("lm_eval", "hf", model_args, tasks, args.work, args.work / "out-hf", limit)
        report["hf"] = {"process_seconds": wall, "acc": {t: results[t]["acc,none"] for t in tasks}}
    if not args.skip_vllm:
        requests = args.work / "vllm_requests.json"
        requests.write_text(json.dumps(pairs))
        report["vllm"] = {}
        for kv in args.kv_cache_dtypes.split(","):  # vLLM's names: auto, fp8, fp8_e4m3, fp8_e5m2 (bfloat16 too)
            vllm = run_vllm(args, requests, model_folder, kv)
            vllm["acc"] = accuracy(vllm.pop("loglikelihoods"), keys, tasks)
            report["vllm"][kv] = vllm
            print(f"vllm {kv}: {vllm['wall_seconds']:.1f} s, acc over all {vllm['acc']['all']:.4f}", file=sys.stderr,
                  flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
