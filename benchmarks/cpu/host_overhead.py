"""The engine's own time per step, apart from the model's forward, on a model so small its forward is cheap.

    python benchmarks/cpu/host_overhead.py                       # this checkout
    python benchmarks/cpu/host_overhead.py --baseline REV        # and, in the same run, the code at git REV
    python benchmarks/cpu/host_overhead.py --seqs 1024 --stub-forward --baseline REV   # the host work alone

A 2-layer Llama-shaped model (hidden 64, SmolLM2's 49,152-token vocabulary, random weights) runs 2,400 rows
that share 8 long documents, 16 output tokens each, up to 256 sequences per step, float32 on the CPU, on the
torch path. Host time per step is the step's wall time minus the time inside the model's forward (the linear
layers, attention and the backend's per-step attention plan): everything the engine itself does per step,
the scheduler, building the runner's metadata, sampling, appending tokens, stop checks, statistics. The
engine's own breakdown (stats columns schedule_ms, prepare_ms, sample_ms, bookkeeping_ms) is printed where
the code has it. Steps with at least 200 running sequences are the ones reported; of them, the decode-only steps
(no prompt token: the step the issue 38 H200 figure is, 2.1 ms of host work at 511 sequences) and the steps that
admitted a waiting request also alone.

`--seqs N` runs up to N sequences a step with a budget of 8N tokens (256 and 2,048 by default) and reports the
steps with at least 200N/256 of them. `--stub-forward` replaces the model's forward by a stub that returns a fixed
token for every sampled row (or zero logits), so a step is the engine's own work alone, as on a GPU where the
forward runs beside it.

The baseline runs the same script against another revision (a temporary git worktree), as a child process,
so both figures come from one run on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 49152, 64, 256, 2, 4, 2
DOCUMENTS, QUESTIONS, DOCUMENT_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 8, 300, 1500, 20, 16
MIN_SEQS_PER_256 = 200
STUB_TOKEN = 7  # what the stubbed forward samples for every row: neither EOS nor anything a stop string reads


def tiny_model():
    try:
        from batchprefill.model.config import ModelConfig
        from batchprefill.model.decoder import DecoderModel as Model
    except ImportError:  # revisions before the model families
        from batchprefill.model.llama import LlamaModel as Model
        from batchprefill.model.llama import ModelConfig

    try:
        from batchprefill.kernels.torch.ops import TorchOps
    except ImportError:
        try:  # revisions before the kernels had a folder per backend
            from batchprefill.kernels.torch_ops import TorchOps
        except ImportError:  # revisions before the kernels were split
            from batchprefill.kernels.ops import TorchOps
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
        num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_positions=8192, tie_word_embeddings=True, qkv_bias=False,
        eos_token_ids=(2,),
    )
    generator = torch.Generator().manual_seed(0)
    kv = KV_HEADS * HIDDEN // HEADS

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    weights = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(HIDDEN),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                    p + "self_attn.q_proj.weight": weight(HIDDEN, HIDDEN),
                    p + "self_attn.k_proj.weight": weight(kv, HIDDEN),
                    p + "self_attn.v_proj.weight": weight(kv, HIDDEN),
                    p + "self_attn.o_proj.weight": weight(HIDDEN, HIDDEN),
                    p + "mlp.gate_proj.weight": weight(FFN, HIDDEN), p + "mlp.up_proj.weight": weight(FFN, HIDDEN),
                    p + "mlp.down_proj.weight": weight(HIDDEN, FFN)}
    return Model(config, weights, TorchOps())


def rows() -> list[list[int]]:
    """Documents x questions, in prefix order (as a job runs them)."""
    rng = random.Random(0)
    documents = [[rng.randrange(3, VOCAB) for _ in range(DOCUMENT_TOKENS)] for _ in range(DOCUMENTS)]
    return sorted(d + [rng.randrange(3, VOCAB) for _ in range(QUESTION_TOKENS)] for d in documents
                  for _ in range(QUESTIONS))


def stub_forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: object,
                 logits_rows: torch.Tensor, greedy: bool = False, lora: object = None) -> torch.Tensor:
    """The model's forward without the model: STUB_TOKEN for every sampled row (or zero logits, where it argmaxes)."""
    if greedy:
        return torch.full((len(logits_rows),), STUB_TOKEN, dtype=torch.int64)
    logits = torch.zeros(len(logits_rows), VOCAB)
    logits[:, STUB_TOKEN] = 1.0
    return logits


def measure(seqs: int, stub: bool) -> dict:
    from batchprefill.engine.engine import Engine, EngineConfig
    from batchprefill.engine.request import Request

    try:
        from batchprefill.sampling_params import SamplingParams
    except ImportError:  # revisions before it was a module of its own
        from batchprefill.engine.request import SamplingParams

    try:  # as a job does (pipeline/build_engine.py): without it each step's large arrays page-fault in anew
        from batchprefill.malloc import keep_freed_memory

        keep_freed_memory()
    except ImportError:  # revisions before it
        pass
    torch.set_num_threads(int(os.environ.get("BP_THREADS", "2")))
    model = tiny_model()
    forward_seconds: list[float] = []
    inner = stub_forward if stub else model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        logits = inner(*args, **kwargs)
        forward_seconds.append(time.perf_counter() - start)
        return logits

    model.forward = timed_forward
    prompts = rows()
    tokens = sum(map(len, prompts)) + len(prompts) * OUTPUT_TOKENS
    fields = {"block_size": 16, "max_batched_tokens": 8 * seqs, "max_num_seqs": seqs}
    if "settings" in {field.name for field in dataclasses.fields(EngineConfig)}:
        from batchprefill.engine.config import EngineSettings

        config = EngineConfig(EngineSettings(**fields), num_blocks=tokens // 16 + 512)
    else:  # revisions before the config held the engine settings
        config = EngineConfig(**fields, num_blocks=tokens // 16 + 512)
    engine = Engine(model, config, lambda ids: "", ("tiny",), torch.float32, torch.device("cpu"))
    requests = [Request(i, p, SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)) for i, p in enumerate(prompts)]
    try:  # as a job does: the order stage's shared-block counts let neighbours share block keys
        import pyarrow as pa

        try:
            from batchprefill.pipeline.order import shared_with_previous
            from batchprefill.pipeline.requests import link_prefix_donors
        except ImportError:  # revisions before the pipeline folder
            from batchprefill.job import link_prefix_donors
            from batchprefill.order import shared_with_previous

        link_prefix_donors(requests, shared_with_previous(pa.chunked_array([prompts]),
                                                          pa.chunked_array([[""] * len(prompts)]), 16))
    except ImportError:  # revisions before the link
        pass
    # Which steps admitted a waiting request: running grows in `schedule` only by admission (and shrinks by
    # preemption), so a step admitted (after - before + preempted) requests.
    scheduler, admitted = engine.scheduler, []
    schedule = scheduler.schedule

    def counted_schedule():
        before, preempted = len(scheduler.running), scheduler.preemptions
        step = schedule()
        admitted.append(len(scheduler.running) - before + scheduler.preemptions - preempted)
        return step

    scheduler.schedule = counted_schedule
    start = time.perf_counter()
    finished = sum(1 for _ in engine.generate(requests))
    wall = time.perf_counter() - start
    assert finished == len(prompts)
    steps = engine.counters.steps
    assert len(steps) == len(forward_seconds), "one forward per step"
    assert len(steps) == len(admitted), "one schedule per step"
    busy = [(s, f, a) for s, f, a in zip(steps, forward_seconds, admitted)
            if s.num_seqs >= MIN_SEQS_PER_256 * seqs // 256]
    host = [s.duration_ms - 1e3 * f for s, f, _ in busy]
    result = {"steps": len(steps), "busy_steps": len(busy), "wall_s": round(wall, 2),
              "step_ms": round(statistics.mean(s.duration_ms for s, _, _ in busy), 2),
              "forward_ms": round(1e3 * statistics.mean(f for _, f, _ in busy), 2),
              "host_ms": round(statistics.mean(host), 2), "host_ms_median": round(statistics.median(host), 2),
              "seqs": round(statistics.mean(s.num_seqs for s, _, _ in busy), 1)}
    # The steps that admitted a waiting request (the prefix cache's match, the pool's allocation), and the
    # decode-only ones (no prompt token), each alone.
    for kind, chosen in (("admit", [(s, f) for s, f, a in busy if a > 0]),
                         ("decode_only", [(s, f) for s, f, _ in busy if s.num_prefill_tokens == 0])):
        if chosen:
            result[kind + "_steps"] = len(chosen)
            result[kind + "_host_ms_median"] = round(statistics.median(s.duration_ms - 1e3 * f for s, f in chosen), 3)
            for phase in ("schedule_ms", "prepare_ms", "bookkeeping_ms"):
                result[kind + "_" + phase[:-3] + "_median_ms"] = round(
                    statistics.median(getattr(s, phase) for s, _ in chosen), 3)
    for phase in ("schedule_ms", "prepare_ms", "sample_ms", "bookkeeping_ms"):
        if hasattr(busy[0][0], phase):
            result[phase] = round(statistics.mean(getattr(s, phase) for s, _, _ in busy), 3)
            result[phase[:-3] + "_median_ms"] = round(statistics.median(getattr(s, phase) for s, _, _ in busy), 3)
    return result


def run_revision(rev: str, options: list[str]) -> dict:
    """This script's measurement (with the same `options`) on the code at `rev`, in a temporary worktree, as a child
    process."""
    from revisions import checkout

    with checkout(rev) as tree:
        done = subprocess.run([sys.executable, __file__, "--json", *options],
                              env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(name: str, r: dict) -> None:
    phases = ", ".join(f"{k[:-3]} {r[k]:.2f} (median {r.get(k[:-3] + '_median_ms', float('nan')):.2f})"
                       for k in ("schedule_ms", "prepare_ms", "sample_ms", "bookkeeping_ms") if k in r)
    print(f"{name:>10}: {r['busy_steps']} steps at {r['seqs']:.0f} seqs: step {r['step_ms']:.2f} ms = forward "
          f"{r['forward_ms']:.2f} + host {r['host_ms']:.2f} ms (median {r['host_ms_median']:.2f}; "
          f"{r['host_ms'] / r['step_ms']:.0%} of the step){'; ' + phases if phases else ''}")
    for kind, words in (("admit", "admitting"), ("decode_only", "decode-only")):
        if kind + "_steps" in r:
            phases = ", ".join(f"{phase} {r[f'{kind}_{phase}_median_ms']:.3f}"
                               for phase in ("schedule", "prepare", "bookkeeping"))
            print(f"{'':>10}  {r[kind + '_steps']} {words} steps, medians: host "
                  f"{r[kind + '_host_ms_median']:.3f} ms; {phases}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision to measure side by side")
    parser.add_argument("--json", action="store_true", help="print this checkout's figures as one JSON line")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seqs", type=int, default=256, help="most sequences a step (the token budget is 8x)")
    parser.add_argument("--stub-forward", action="store_true", help="time the engine's own work alone")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.seqs, args.stub_forward)))
        return
    options = ["--seqs", str(args.seqs), *(["--stub-forward"] if args.stub_forward else [])]
    results = {"this": measure(args.seqs, args.stub_forward)}
    if args.baseline:
        results["baseline"] = run_revision(args.baseline, options)
    for name, r in results.items():
        report(name, r)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
