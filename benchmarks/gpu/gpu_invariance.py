"""engine.batch_invariant on the GPU: what the interpreter cannot show (MMA layouts, TF32, fused multiply-adds).

A section of benchmarks/gpu/gpu.py ("invariance"); `python benchmarks/gpu/gpu.py --smoke` runs it at toy sizes on
the CPU.
Every comparison is bitwise, on the batch-invariant path (a failure if any bit differs) and, for the record only,
on the default path (how many rows differ there):

- linears (`invariant_linear` against cuBLAS's `F.linear`): rows of 1, 3, 64 and 255 calls against the same rows of
  a 1024-row call, and a shuffled batch, at SmolLM2's gate_up and Llama-3-8B's QKV shapes, bf16 and fp32;
- attention at SmolLM2's heads: a 1000-token prompt as one chunk against chunks cut at 1, 129 and 700, its last
  tokens as decodes, beside other chunks and decodes, and under a 256-token window;
- the fused MoE: tokens alone, in 37 and in a shuffled batch of 512;
- an engine on a random SmolLM2-shaped model: tokens and logprobs with one sequence at a time in 256-token chunks
  against 8 at a time in 2048-token steps with CUDA graphs, and the wall time of a warm repeat of the second, so
  the invariant path's cost shows beside the default's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gpu_e2e
import torch
import torch.nn.functional as F

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.triton.matmul import invariant_linear
from batchprefill.kernels.triton.moe import fused_experts
from batchprefill.kernels.triton.ops import TritonOps
from batchprefill.model.moe import route
from tests.synthetic import attention_of_entries, random_sequences


@dataclass(frozen=True)
class Sizes:
    linears: tuple[tuple[int, int], ...]  # weights (out, in)
    rows: int
    subsets: tuple[int, ...]
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    prompt: int
    cuts: tuple[int, ...]
    companions: tuple[int, int]  # lengths of the two sequences that share steps with the prompt
    window: int
    moe: tuple[int, int, int, int, int]  # tokens, hidden, expert width, experts, top k
    workload: gpu_e2e.Workload
    chunk: int  # the small engine run's step budget


FULL = Sizes(
    linears=((3072, 576), (6144, 4096)),
    rows=1024,
    subsets=(1, 3, 64, 255),
    heads=(9, 3, 64),
    prompt=1000,
    cuts=(1, 129, 700),
    companions=(700, 400),
    window=256,
    moe=(512, 1024, 768, 16, 4),
    workload=replace(gpu_e2e.SMOLLM2, max_tokens=8),
    chunk=256,
)
SMOKE = Sizes(
    linears=((48, 40),),
    rows=70,
    subsets=(1, 33),
    heads=(2, 1, 32),
    prompt=100,
    cuts=(37, 64),
    companions=(50, 20),
    window=40,
    moe=(40, 32, 24, 4, 2),
    workload=gpu_e2e.SMOKE,
    chunk=16,
)
BLOCK_SIZE = 16


def _row(check: str, invariant: bool, differing: int, rows: int, max_diff: float) -> dict:
    status = ("ok" if differing == 0 else "FAIL") if invariant else "(default, for the record)"
    print(
        f"  {check:<58} {'invariant' if invariant else 'default  '} {differing:>5} of {rows:>5} rows differ, "
        f"max |diff| {max_diff:.2e}  {status}"
    )
    return {"check": check, "invariant": invariant, "differing": differing, "rows": rows, "max_diff": max_diff}


def _count(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    """(rows of `got` that differ from `want` in any bit, the largest difference)."""
    same = (got == want).flatten(1).all(1)
    return int((~same).sum()), (got.float() - want.float()).abs().max().item()


def _linears(s: Sizes, device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n, k in s.linears:
        for dtype in (torch.bfloat16, torch.float32):
            weight = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
            x = torch.randn(s.rows, k, generator=gen, device=device).to(dtype)
            order = torch.randperm(s.rows, generator=gen, device=device)
            for invariant, linear in ((True, invariant_linear), (False, F.linear)):
                full = linear(x, weight)
                parts = [linear(x[:m], weight) for m in s.subsets] + [linear(x[order], weight)]
                wants = [full[:m] for m in s.subsets] + [full[order]]
                counts = [_count(got, want) for got, want in zip(parts, wants, strict=True)]
                name = f"linear {n}x{k} {str(dtype)[6:]}, rows {'/'.join(map(str, s.subsets))}/shuffled"
                rows.append(
                    _row(
                        name,
                        invariant,
                        sum(c for c, _ in counts),
                        sum(len(p) for p in parts),
                        max(d for _, d in counts),
                    )
                )
    return rows


def _attention(s: Sizes, device: torch.device) -> list[dict]:
    q_heads, kv_heads, head_dim = s.heads
    n, (other, third) = s.prompt, s.companions
    seqs = random_sequences([n, other + 1, third + 2], q_heads, kv_heads, head_dim, torch.bfloat16, device)
    bounds = [0, *s.cuts, n]
    cases = {
        "chunks": [[(0, lo, hi - lo)] for lo, hi in zip(bounds, bounds[1:], strict=False)],
        "last two as decodes": [[(0, 0, n - 2)], [(0, n - 2, 1)], [(0, n - 1, 1)]],
        "beside chunks and decodes": [
            [(1, 0, other), (0, 0, s.cuts[-1]), (2, third, 1)],
            [(2, third + 1, 1), (0, s.cuts[-1], n - s.cuts[-1]), (1, other, 1)],
        ],
    }
    rows = []
    for invariant in (True, False):
        ops = TritonOps(batch_invariant=invariant)
        for window in (None, s.window):
            alone = attention_of_entries(ops, seqs, [(0, 0, n)], BLOCK_SIZE, window)
            for name, steps in cases.items():
                differing, diff, total = 0, 0.0, 0
                for entries in steps:
                    got = {
                        key: row
                        for key, row in attention_of_entries(ops, seqs, entries, BLOCK_SIZE, window).items()
                        if key[0] == 0
                    }
                    keys = list(got)
                    count, most = _count(torch.stack([got[k] for k in keys]), torch.stack([alone[k] for k in keys]))
                    differing, diff, total = differing + count, max(diff, most), total + len(keys)
                label = f"attention {n} tokens, {name}" + (f", window {window}" if window else "")
                rows.append(_row(label, invariant, differing, total, diff))
    return rows


def _moe(s: Sizes, device: torch.device) -> list[dict]:
    tokens, hidden, width, num_experts, top_k = s.moe
    gen = torch.Generator(device=device).manual_seed(1)
    experts = ExpertWeights(
        (torch.randn(num_experts, 2 * width, hidden, generator=gen, device=device) * hidden**-0.5).bfloat16(),
        (torch.randn(num_experts, hidden, width, generator=gen, device=device) * width**-0.5).bfloat16(),
    )
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen, device=device), top_k, normalize=False)
    order = torch.randperm(tokens, generator=gen, device=device)
    rows = []
    for invariant in (True, False):
        full = fused_experts(x, experts, weights, ids, invariant)
        parts = [
            (slice(0, 1), fused_experts(x[:1], experts, weights[:1], ids[:1], invariant)),
            (slice(0, 37), fused_experts(x[:37], experts, weights[:37], ids[:37], invariant)),
            (order, fused_experts(x[order], experts, weights[order], ids[order], invariant)),
        ]
        counts = [_count(got, full[which]) for which, got in parts]
        rows.append(
            _row(
                f"moe {num_experts} experts top {top_k}, 1/37/shuffled of {tokens}",
                invariant,
                sum(c for c, _ in counts),
                sum(len(got) for _, got in parts),
                max(d for _, d in counts),
            )
        )
    return rows


def _engine_runs(s: Sizes, device: torch.device) -> list[dict]:
    w, dtype = s.workload, torch.bfloat16
    prompts = gpu_e2e.prompts(w)
    graphs = "graphs" if device.type == "cuda" else "eager"
    rows = []
    for invariant in (True, False):
        model = gpu_e2e.random_model(w, dtype, device, batch_invariant=invariant)
        outputs, walls = [], []
        batched = (w.max_num_seqs, w.budget, graphs)
        repeat = [batched] if device.type == "cuda" else []  # timed warm; off the GPU the time means nothing
        for max_num_seqs, budget, padded in [(1, s.chunk, "off"), batched, *repeat]:
            settings = EngineSettings(block_size=BLOCK_SIZE, max_batched_tokens=budget, max_num_seqs=max_num_seqs)
            blocks = sum(len(p) + w.max_tokens for p in prompts) // BLOCK_SIZE + len(prompts) + w.max_num_seqs
            engine = Engine(
                model,
                EngineConfig(settings, num_blocks=blocks, padded_decode=padded),
                lambda ids: "",
                ("random", str(dtype), invariant),
                dtype,
                device,
            )
            finished, wall = gpu_e2e.generate(engine, w, prompts, device, logprobs=0)
            outputs.append({r.request_id: (r.output_token_ids, r.output_logprobs) for r in finished})
            walls.append(wall)
        one, many = outputs[0], outputs[1]
        differing = sum(one[i] != many[i] for i in one)
        diff = max(abs(a - b) for i in one for a, b in zip(one[i][1], many[i][1], strict=True))
        name = f"engine {len(prompts)} prompts, 1 seq / {s.chunk}-token steps vs {w.max_num_seqs} / {w.budget}"
        rows.append(_row(name, invariant, differing, len(prompts), diff) | {"warm_wall_s": round(walls[-1], 3)})
        del model
    return rows


def run(smoke: bool, device: torch.device) -> list[dict]:
    """Every comparison's row: check, invariant (the path), differing and rows, max_diff; the engine's rows also
    the warm wall time of the 8-at-a-time run."""
    s = SMOKE if smoke else FULL
    print("batch invariance (bitwise; the default path for the record):")
    return _linears(s, device) + _attention(s, device) + _moe(s, device) + _engine_runs(s, device)
