"""End-to-end engine throughput on a random-weight model of Llama-3-8B's shape, prefix caching on and off.

The weights are random, so the text is noise, but every matmul, kernel, scheduler step and CUDA graph is
the real one. The workload is shared-prefix: a few long system prompts, each with many short questions.

Both settings first run a small warm-up workload (every kernel variant compiles there, not on the clock),
then each is timed twice, alternating. A third, probed run of each measures how long the GPU waits on
the host per step: each forward pass (or graph replay) starts behind a GPU spin long enough for the host
to queue all of it, so the span from the spin's end to the pass's end is the GPU's own time; a step's
host wait is its timed wall time minus that. The goal: no step waits more than 10% of its wall time.

The engines run the overlapped loop (EngineConfig.overlap, as jobs do on CUDA; the smoke run too, on the CPU): a
step's wall time is then from one launch to the next, and its host work (schedule, prepare, launch, the previous
step's bookkeeping) runs while the device computes; `host_ms` is that work, the wall time less the wait for tokens.
benchmarks/gpu/gpu.py runs this section with the others; alone, on a GPU:

    python benchmarks/gpu/gpu_e2e.py            # the overlapped loop
    python benchmarks/gpu/gpu_e2e.py --sync     # the synchronous loop, for the comparison
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace

import torch

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.counters import StepStats
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.kernels.triton.ops import TritonOps
from batchprefill.model.config import ModelConfig
from batchprefill.model.decoder import DecoderModel
from batchprefill.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    prefixes: int
    questions: int
    prefix_tokens: int
    question_tokens: int
    max_tokens: int
    budget: int
    max_num_seqs: int


LLAMA3_8B = Workload(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, prefixes=4,
                     questions=64, prefix_tokens=2048, question_tokens=64, max_tokens=32, budget=8192,
                     max_num_seqs=256)
SMOLLM2 = Workload(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3, vocab=49152, prefixes=1, questions=8,
                   prefix_tokens=256, question_tokens=16, max_tokens=4, budget=2048, max_num_seqs=8)
SMOKE = Workload(layers=1, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=512, prefixes=2, questions=2,
                 prefix_tokens=32, question_tokens=5, max_tokens=2, budget=48, max_num_seqs=4)


HOST_WAIT_GOAL = 0.10  # the most of a step's wall time the GPU may spend waiting on the host
SPIN_MS = 30.0  # GPU spin ahead of each probed pass: longer than the host takes to launch one


def random_model(w: Workload, dtype: torch.dtype, device: torch.device, batch_invariant: bool = False,
                 values_of: torch.dtype | None = None) -> DecoderModel:
    """`values_of`: round the weights to this dtype first (a float32 model with a bf16 model's exact weights)."""
    head_dim = w.hidden // w.heads
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.ffn,
        num_layers=w.layers, num_heads=w.heads, num_kv_heads=w.kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=None, max_positions=8192, tie_word_embeddings=False, qkv_bias=False,
        eos_token_ids=(0,),
    )
    generator = torch.Generator(device=device).manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        drawn = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * 0.02
        return drawn.to(values_of or dtype).to(dtype)

    kv = w.kv_heads * head_dim
    weights = {"model.embed_tokens.weight": weight(w.vocab, w.hidden), "lm_head.weight": weight(w.vocab, w.hidden),
               "model.norm.weight": torch.ones(w.hidden, device=device, dtype=dtype)}
    for i in range(w.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(w.hidden, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(w.hidden, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": weight(w.hidden, w.hidden),
            p + "self_attn.k_proj.weight": weight(kv, w.hidden),
            p + "self_attn.v_proj.weight": weight(kv, w.hidden),
            p + "self_attn.o_proj.weight": weight(w.hidden, w.hidden),
            p + "mlp.gate_proj.weight": weight(w.ffn, w.hidden),
            p + "mlp.up_proj.weight": weight(w.ffn, w.hidden),
            p + "mlp.down_proj.weight": weight(w.hidden, w.ffn),
        }
    return DecoderModel(config, weights, TritonOps(batch_invariant=batch_invariant))


def prompts(w: Workload) -> list[list[int]]:
    """System prompts x questions, shuffled: the engine sees them in prefix order, as a job would run them."""
    rng = random.Random(0)
    systems = [[rng.randrange(1, w.vocab) for _ in range(w.prefix_tokens)] for _ in range(w.prefixes)]
    rows = [s + [rng.randrange(1, w.vocab) for _ in range(w.question_tokens)]
            for s in systems for _ in range(w.questions)]
    return sorted(rows)


def _engine(model: DecoderModel, w: Workload, rows: list[list[int]], caching: bool, dtype: torch.dtype,
            device: torch.device, overlap: bool = True) -> Engine:
    settings = EngineSettings(block_size=16, max_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
                              prefix_caching=caching)
    config = EngineConfig(settings, num_blocks=sum(len(r) + w.max_tokens for r in rows) // 16 + w.max_num_seqs,
                          padded_decode="graphs" if device.type == "cuda" else "eager", overlap=overlap)
    return Engine(model, config, lambda ids: "", ("random", str(dtype)), dtype, device)


def generate(engine: Engine, w: Workload, rows: list[list[int]], device: torch.device,
             logprobs: int | None = None) -> tuple[list, float]:
    """(finished requests, wall seconds) of `w.max_tokens` greedy tokens for each row."""
    sampling = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, logprobs=logprobs)
    requests = [Request(i, r, sampling) for i, r in enumerate(rows)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    finished = list(engine.generate(requests))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert len(finished) == len(rows)
    return finished, time.perf_counter() - start


class GpuTimer:
    """Wraps the model's forward and every captured graph's replay: a GPU spin first, then events around
    the pass. Only the probed run uses it; its wall times include the spins and are not reported."""

    def __init__(self, engine: Engine, device: torch.device):
        self.engine = engine
        self.spans: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self.uncovered = 0  # passes whose launches took the host longer than the spin: their GPU time has gaps
        calibration = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calibration[0].record()
        torch.cuda._sleep(1_000_000)
        calibration[1].record()
        torch.cuda.synchronize(device)
        self.spin_cycles = int(1_000_000 * SPIN_MS / calibration[0].elapsed_time(calibration[1]))
        model = engine.runner.model
        model.forward = self._timed(model.forward)
        decoder = engine.runner.decoder
        self.graphs = dict(decoder.graphs) if decoder is not None else {}  # given back by `restore`
        for size, (graph, logits) in self.graphs.items():
            decoder.graphs[size] = (_Replay(self._timed(graph.replay)), logits)

    def _timed(self, call):
        def timed(*args, **kwargs):
            torch.cuda._sleep(self.spin_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter()
            result = call(*args, **kwargs)
            self.uncovered += (time.perf_counter() - began) * 1e3 >= SPIN_MS
            end.record()
            self.spans.append((len(self.engine.counters.steps), start, end))
            return result
        return timed

    def restore(self) -> None:
        """The model is shared by later engines: give it back its own forward, and the engine its own graphs (the
        wrapped replays refer to this timer, which refers to the engine: a cycle that kept an 8B run's pool alive)."""
        del self.engine.runner.model.forward
        if self.engine.runner.decoder is not None:
            self.engine.runner.decoder.graphs.update(self.graphs)
        self.graphs = {}

    def gpu_ms_per_step(self) -> dict[int, float]:
        busy: dict[int, float] = {}
        for step, start, end in self.spans:
            busy[step] = busy.get(step, 0.0) + start.elapsed_time(end)
        return busy


@dataclass
class _Replay:
    replay: object


def _host_wait(steps: list[StepStats], gpu_ms: dict[int, float], probed_steps: int) -> dict:
    """Per step, the share of its wall time the GPU spent waiting on the host, from a timed run's wall
    times and a probed run's GPU times (the same schedule: the workload and sampling are deterministic)."""
    if len(steps) != probed_steps:
        return {"error": f"the probed run took {probed_steps} steps, the timed run {len(steps)}"}
    rows = []
    for record in steps:
        if record.num_decode_tokens + record.num_prefill_tokens == 0:
            continue  # a step that ran nothing on the GPU
        gpu = gpu_ms.get(record.step, 0.0)
        rows.append({"step": record.step, "decode_tokens": record.num_decode_tokens,
                     "prefill_tokens": record.num_prefill_tokens, "wall_ms": round(record.duration_ms, 3),
                     "host_ms": round(record.duration_ms - record.token_wait_ms, 3),
                     "gpu_ms": round(gpu, 3), "wait_frac": max(0.0, 1 - gpu / record.duration_ms)})
    fractions = sorted(r["wait_frac"] for r in rows)
    worst = max(rows, key=lambda r: r["wait_frac"])
    return {"steps": len(rows), "median_wait_frac": statistics.median(fractions),
            "p90_wait_frac": fractions[int(0.9 * (len(fractions) - 1))], "max_wait_frac": worst["wait_frac"],
            "steps_over_goal": sum(f > HOST_WAIT_GOAL for f in fractions), "worst_step": worst,
            "median_host_ms": statistics.median(r["host_ms"] for r in rows),
            "median_gpu_ms": statistics.median(r["gpu_ms"] for r in rows),
            "goal_met": worst["wait_frac"] <= HOST_WAIT_GOAL}


def run(smoke: bool, device: torch.device, overlap: bool = True) -> dict:
    w = SMOKE if smoke else LLAMA3_8B
    dtype = torch.float32 if smoke else torch.bfloat16
    model = random_model(w, dtype, device)
    rows = prompts(w)
    warm_workload = replace(w, prefixes=1, questions=min(w.questions, 8))
    for caching in (True, False):  # compile every kernel variant before the clock starts
        with _engine(model, warm_workload, prompts(warm_workload), caching, dtype, device, overlap) as engine:
            generate(engine, warm_workload, prompts(warm_workload), device)
    runs, timed_steps = [], {}
    for repeat in (1, 2):
        for caching in (True, False):
            engine = _engine(model, w, rows, caching, dtype, device, overlap)
            finished, wall = generate(engine, w, rows, device)
            prefill, output = engine.counters.prefill_tokens, sum(len(r.output_token_ids) for r in finished)
            runs.append({"prefix_caching": caching, "repeat": repeat, "requests": len(rows),
                         "prompt_tokens": sum(map(len, rows)), "computed_prompt_tokens": prefill,
                         "output_tokens": output, "wall_s": round(wall, 3),
                         "prefill_tokens_per_s": round(prefill / wall), "output_tokens_per_s": round(output / wall),
                         "steps": len(engine.counters.steps)})
            timed_steps[caching] = engine.counters.steps
            engine.close()
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    host_wait = {}
    for caching in (True, False):
        if device.type != "cuda":
            host_wait[f"caching_{'on' if caching else 'off'}"] = {"error": "the probe needs CUDA"}
            continue
        probed = _engine(model, w, rows, caching, dtype, device, overlap)
        timer = GpuTimer(probed, device)
        generate(probed, w, rows, device)
        timer.restore()
        probed.close()
        wait = _host_wait(timed_steps[caching], timer.gpu_ms_per_step(), len(probed.counters.steps))
        host_wait[f"caching_{'on' if caching else 'off'}"] = wait | {"passes_longer_than_spin": timer.uncovered}
        del probed, timer
        torch.cuda.empty_cache()
    _print(w, smoke, runs, host_wait, overlap)
    return {"runs": runs, "host_wait": host_wait}


def _print(w: Workload, smoke: bool, runs: list[dict], host_wait: dict, overlap: bool) -> None:
    print(f"end to end ({'smoke' if smoke else 'Llama-3-8B shape, random weights, bf16'}, "
          f"{'overlapped' if overlap else 'synchronous'} loop; "
          f"{w.prefixes} prefixes x {w.questions} questions, {w.prefix_tokens}+{w.question_tokens} prompt tokens, "
          f"{w.max_tokens} output tokens; warmed up, each setting timed twice):")
    for r in runs:
        print(f"  prefix caching {'on ' if r['prefix_caching'] else 'off'} (run {r['repeat']}): {r['wall_s']:8.2f} s, "
              f"computed {r['computed_prompt_tokens']:>8} prompt tokens, {r['prefill_tokens_per_s']:>8} prefill tok/s, "
              f"{r['output_tokens_per_s']:>7} output tok/s, {r['steps']} steps")
    best = {c: min(r["wall_s"] for r in runs if r["prefix_caching"] == c) for c in (True, False)}
    print(f"  wall time ratio off/on (best of two each): {best[False] / best[True]:.2f}x")
    for name, wait in host_wait.items():
        if "error" in wait:
            print(f"  host wait, {name}: {wait['error']}")
        else:
            print(f"  host wait, {name}: median {wait['median_wait_frac']:.1%}, p90 {wait['p90_wait_frac']:.1%}, "
                  f"worst {wait['max_wait_frac']:.1%} (step {wait['worst_step']['step']}), "
                  f"{wait['steps_over_goal']} of {wait['steps']} steps over {HOST_WAIT_GOAL:.0%}; median host work "
                  f"{wait['median_host_ms']:.2f} ms a step beside {wait['median_gpu_ms']:.2f} ms of GPU")


if __name__ == "__main__":  # the end-to-end section alone: python benchmarks/gpu/gpu_e2e.py [--sync]
    import sys

    run(False, torch.device("cuda"), overlap="--sync" not in sys.argv[1:])
