"""GPU benchmark of the Triton kernels: correctness against torch, measured ceilings, speed against SDPA.

    python benchmarks/gpu/gpu.py [--out benchmarks/results/gpu_results.json]   # one H200: about 5 minutes, under 8
    python benchmarks/gpu/gpu.py --smoke --out /tmp/smoke.json          # tiny shapes, CPU interpreter

In order: correctness (every kernel against TorchOps at Llama-3-8B's shape (32 query heads, 8 KV heads,
head dim 128) and at the shipped SmolLM2's (9 and 3, head dim 64), long chunks on 128-row tiles, a
replayed CUDA graph against the eager forward on the same buffers), the device's copy and matmul
ceilings, the prefill and decode kernel tables against PyTorch's SDPA, the shared-prefix decode table (issue 38's
shapes, against its bytes floor and the ungrouped decode on the same blocks), then the end-to-end engine
(gpu_e2e.py); the batch-invariance checks (gpu_invariance.py) run after the correctness ones. Each
section that fails is recorded and the next one still runs; the results file is rewritten after every
section, so a run cut short keeps what it measured. Timed kernels are warmed up, and L2 is flushed before
every timed call. The smoke mode runs every step at toy sizes with wall-clock timing, only to prove the
script works.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpu_e2e  # noqa: E402
import gpu_invariance  # noqa: E402
import gpu_moe  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from batchprefill.engine.decode_graphs import PaddedDecode  # noqa: E402
from batchprefill.kernels.fp8_kv import to_cache  # noqa: E402
from batchprefill.kernels.interface import AttentionMetadata  # noqa: E402
from batchprefill.kernels.shared_prefix import DecodeGroups  # noqa: E402
from batchprefill.kernels.torch.ops import TorchOps  # noqa: E402
from batchprefill.kernels.triton.ops import TritonOps  # noqa: E402
from batchprefill.model.rope import rope_cos_sin  # noqa: E402
from tests.synthetic import random_paged_batch  # noqa: E402

PREFILL_GOAL = 0.8  # Triton prefill speed / flash SDPA speed, on equal work
DECODE_GOAL = 0.7  # fraction of measured copy bandwidth, at contexts of at least DECODE_GOAL_CONTEXT
DECODE_GOAL_CONTEXT = 8192
TOLERANCE = 2e-2  # bf16
L2_FLUSH_BYTES = 256 << 20  # H200's L2 is 50 MiB


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int


LLAMA3_8B = Shape(32, 8, 128)
LLAMA32_1B = Shape(32, 8, 64)
SMOLLM2 = Shape(9, 3, 64)  # the shipped model: GQA 3:1


@dataclass(frozen=True)
class SharedLayout:
    """A decode step of `groups` groups of `members` sequences, each over `shared` tokens of its group's prefix
    and 20-40 tokens of its own (the query's included)."""

    groups: int
    members: int
    shared: int


@dataclass
class Plan:
    """Model shapes and the batches to check and to time."""

    shape: Shape = LLAMA3_8B
    block_size: int = 16
    # (name, shape, sequences as (cached context, new queries)); chunks of 600 and 700 take 128-row tiles
    checks: list[tuple[str, Shape, list[tuple[int, int]]]] = field(default_factory=lambda: [
        ("mixed prefill+decode", LLAMA3_8B, [(1000, 300), (0, 513), (700, 1), (2000, 1)]),
        ("long chunks, 128-row tiles", LLAMA3_8B, [(0, 600), (300, 700)]),
        ("decode split-K", LLAMA3_8B, [(5000, 1), (300, 1)]),
        ("decode 64 seqs", LLAMA3_8B, [(700, 1)] * 64),
        ("SmolLM2 long chunks", SMOLLM2, [(0, 600), (300, 700)]),
        ("SmolLM2 mixed", SMOLLM2, [(1000, 300), (0, 64), (700, 1), (2000, 1)]),
        ("SmolLM2 decode split-K", SMOLLM2, [(5000, 1), (300, 1), (17, 1)]),
    ])
    ops_settings: dict = field(default_factory=dict)
    graph_model: gpu_e2e.Workload = gpu_e2e.SMOLLM2  # its decode graph is replayed against the eager forward
    graph_contexts: tuple[int, ...] = (3000, 17, 900, 1500, 64)
    # (seq_len, chunk): the chunk is the last `chunk` tokens; chunk == seq_len compares with flash causal
    prefill: list[tuple[int, int]] = field(default_factory=lambda: [
        (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192),
        (4096, 512), (8192, 2048), (16384, 2048), (32768, 512), (32768, 2048),
    ])
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 4096, 8192, 16384, 32768])
    # issue 38's job (16 system prompts of ~700 tokens, 511 decodes) and gpu_e2e's (prefixes of 2,048 tokens)
    shared_shapes: list[tuple[str, Shape]] = field(default_factory=lambda: [
        ("Llama-3.2-1B", LLAMA32_1B), ("Llama-3-8B", LLAMA3_8B)])
    shared_layouts: list[SharedLayout] = field(default_factory=lambda: [
        SharedLayout(16, 32, 704), SharedLayout(4, 128, 2048)])
    shared_rows: tuple[int, ...] = (64, 128)  # TritonOps(shared_rows=...): the group programs' query rows
    graph_max_positions: int = 131072  # the decode grid a graph of a 131k-token model (Llama 3.1 8B) replays
    max_decode_tokens: int = 1 << 20  # 4 GiB of bf16 KV per layer at these shapes, plus SDPA's copy
    copy_bytes: int = 1 << 31
    matmul_size: int = 8192


SMOKE_SHAPE = Shape(4, 2, 32)
SMOKE = Plan(
    shape=SMOKE_SHAPE,
    checks=[("mixed prefill+decode", SMOKE_SHAPE, [(40, 20), (0, 17), (30, 1)]),
            ("decode split-K", SMOKE_SHAPE, [(150, 1), (20, 1)]),
            ("GQA 3:1 mixed", Shape(6, 2, 64), [(30, 20), (50, 1)])],
    ops_settings=dict(decode_min_segment=32), graph_model=gpu_e2e.SMOKE, graph_contexts=(40, 3, 17),
    prefill=[(48, 48), (100, 37)], decode_batches=[1, 3], decode_contexts=[100], graph_max_positions=256,
    shared_shapes=[("smoke", SMOKE_SHAPE)], shared_layouts=[SharedLayout(2, 3, 32)], shared_rows=(64,),
    max_decode_tokens=1 << 10, copy_bytes=1 << 20, matmul_size=64,
)


class Checker:
    """Collects comparisons; `failures` names those beyond the bf16 tolerance."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def compare(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.allclose(got.float(), want.float(), atol=TOLERANCE, rtol=TOLERANCE)
        print(f"  {name:<44} max |err| {err:.2e}  {'ok' if ok else 'FAIL'}")
        self.rows.append({"check": name, "max_err": err, "ok": ok})

    def bound(self, name: str, error: float, bound: float) -> None:
        """A check whose tolerance was measured: `error` may reach `bound` (0 for bitwise checks)."""
        ok = error <= bound
        print(f"  {name:<44} max |err| {error:.2e}  (bound {bound:.2e})  {'ok' if ok else 'FAIL'}")
        self.rows.append({"check": name, "max_err": error, "bound": bound, "ok": ok})

    @property
    def failures(self) -> list[str]:
        return [r["check"] for r in self.rows if not r["ok"]]


def check_kernels(plan: Plan, device: torch.device, dtype: torch.dtype, checker: Checker) -> None:
    """Every TritonOps kernel against TorchOps at both model shapes."""
    reference = TorchOps()
    for seed, (name, shape, specs) in enumerate(plan.checks):
        fast = TritonOps(**plan.ops_settings)  # the default tiles: 128 rows for the long chunks on a GPU
        query, k_cache, v_cache, meta = random_paged_batch(
            specs, shape.heads, shape.kv_heads, shape.head_dim, plan.block_size, dtype, device, seed=seed)
        scale = shape.head_dim**-0.5
        got = fast.attention(query, k_cache, v_cache, meta, scale)
        block_m = fast.plan(meta, k_cache, shape.heads, dtype).plan.block_m
        checker.compare(f"attention, {name} ({block_m}-row tiles)", got,
                        reference.attention(query, k_cache, v_cache, meta, scale))
        window = max(8, max(sum(spec) for spec in specs) // 3)  # a sliding window shorter than the contexts
        checker.compare(f"attention, {name}, window {window}", fast.attention(query, k_cache, v_cache, meta, scale,
                                                                              window),
                        reference.attention(query, k_cache, v_cache, meta, scale, window))

    shape = plan.shape
    fast = TritonOps(**plan.ops_settings)
    query, k_cache, v_cache, meta = random_paged_batch(plan.checks[0][2], shape.heads, shape.kv_heads,
                                                       shape.head_dim, plan.block_size, dtype, device)
    tokens = query.shape[0]
    key, value = (torch.randn(tokens, shape.kv_heads, shape.head_dim, dtype=dtype, device=device) for _ in range(2))
    slots = meta.slot_mapping.clone()
    slots[0] = -1
    caches = [torch.zeros_like(k_cache) for _ in range(4)]
    fast.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    checker.compare("store_kv k", caches[0], caches[2])
    checker.compare("store_kv v", caches[1], caches[3])

    hidden = shape.heads * shape.head_dim
    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    for got, want, part in zip(fast.rms_norm(x, weight, 1e-5, residual),
                               reference.rms_norm(x, weight, 1e-5, residual), ("normed", "residual"), strict=True):
        checker.compare(f"rms_norm {part}", got, want)

    positions = torch.randint(0, 4096, (tokens,), device=device)
    cos_sin = rope_cos_sin(shape.head_dim, 4096, 500000.0).to(device)
    for got, want, part in zip(fast.rope(query, key, positions, cos_sin),
                               reference.rope(query, key, positions, cos_sin), ("q", "k"), strict=True):
        checker.compare(f"rope {part}", got, want)


def check_decode_graph(plan: Plan, device: torch.device, dtype: torch.dtype, checker: Checker) -> None:
    """A random-weight model of the shipped shape, one padded decode step (5 rows in the graph of 8, rows 0 and
    2 sharing row 2's prefix blocks, so the step runs the shared-prefix decode): the replayed CUDA graph against
    the eager forward on the same buffers (bitwise), and the padded and the unpadded forward each against a float32
    forward of the same weights and cache. The first H200 run compared padded with unpadded directly and found
    0.085 apart in bf16: a matmul over 8 rows and one over 5 round differently, and 30 layers compound it. So the
    padded forward passes when it is no further from float32 than twice the unpadded one (plus one bf16 step of the
    largest logit), and with batch-invariant kernels, where a row's bits do not depend on the rows beside it, padded
    and unpadded must be bitwise equal. Off CUDA no graph is captured."""
    w = plan.graph_model
    contexts = np.asarray(plan.graph_contexts)
    block = plan.block_size
    per_seq = -(-(contexts + 1) // block)
    num_blocks = int(per_seq.sum()) + 3
    gen = torch.Generator(device).manual_seed(1)
    cache_shape = (num_blocks, block, w.kv_heads, w.hidden // w.heads)
    caches = [(torch.randn(cache_shape, generator=gen, device=device).to(dtype),
               torch.randn(cache_shape, generator=gen, device=device).to(dtype)) for _ in range(w.layers)]
    order = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(contexts), per_seq.max()), dtype=np.int32)
    bounds = np.concatenate([[0], np.cumsum(per_seq)])
    for row, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        tables[row, : hi - lo] = order[lo:hi]
    shared = contexts[2] // block  # row 2's whole context before its query: a decode group with row 0
    tables[2, :shared] = tables[0, :shared]
    ids = np.arange(len(contexts)) * 7 + 3
    slots = tables[np.arange(len(contexts)), contexts // block].astype(np.int64) * block + contexts % block
    meta = AttentionMetadata(
        query_start=torch.arange(len(contexts) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(contexts + 1).int().to(device), block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), query_lens_host=[1] * len(contexts),
        seq_lens_host=(contexts + 1).tolist(),
    )

    def unpadded(model, kv) -> torch.Tensor:
        return model(torch.from_numpy(ids).to(device), torch.from_numpy(contexts).to(device), kv, meta,
                     torch.arange(len(contexts), device=device)).float()

    def padded(model, kv, label: str) -> torch.Tensor:
        decoder = PaddedDecode(model, kv, block, w.max_num_seqs, device, capture=device.type == "cuda")
        replayed = decoder.run(ids, contexts, slots, contexts + 1, tables).float().clone()
        size = next(s for s in decoder.sizes if s >= len(contexts))
        if size in decoder.graphs:
            checker.bound(f"{label}decode graph replay vs eager, same buffers", _max_diff(
                replayed, decoder._forward(size)[: len(contexts)].float()), 0.0)
        decoder.close()
        return replayed

    model = gpu_e2e.random_model(w, dtype, device)
    replayed, direct = padded(model, caches, ""), unpadded(model, caches)
    precise = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        exact = unpadded(gpu_e2e.random_model(w, torch.float32, device, values_of=dtype),
                         [(k.float(), v.float()) for k, v in caches])
    finally:
        torch.set_float32_matmul_precision(precise)
    direct_error = _max_diff(direct, exact)
    step = exact.abs().max().item() * 2**-8
    checker.bound("padded decode vs float32 (unpadded: "f"{direct_error:.2e})", _max_diff(replayed, exact),
                  2 * direct_error + step)
    invariant = gpu_e2e.random_model(w, dtype, device, batch_invariant=True)
    checker.bound("batch-invariant padded decode vs unpadded", _max_diff(
        padded(invariant, caches, "batch-invariant "), unpadded(invariant, caches)), 0.0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


class Timer:
    """Median milliseconds of a call: warmed up, L2 flushed before every timed call, CUDA events around it;
    `graph` replays a CUDA graph of the call so launch overhead does not count. Off the GPU (smoke mode)
    one wall-clock call, which only exercises the code."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], object], graph: bool = False, budget_ms: float = 200.0) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        for _ in range(3):
            fn()
        call = fn
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                fn()
            call = captured.replay
        estimate = self._time(call, 3)
        reps = int(min(100, max(10, budget_ms / max(estimate, 1e-3))))
        return self._time(call, reps)

    def _time(self, call: Callable[[], object], reps: int) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize(self.device)
        return float(np.median([start.elapsed_time(end) for start, end in events]))


def measure_ceilings(plan: Plan, device: torch.device, timer: Timer) -> dict[str, float]:
    """What this device really does: device-to-device copy GB/s (read + write) and bf16 matmul TFLOP/s."""
    src = torch.empty(plan.copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    n = plan.matmul_size
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    matmul_ms = timer(lambda: a @ b)
    return {"copy_gbps": 2 * plan.copy_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / matmul_ms / 1e9}


def bench_prefill(plan: Plan, device: torch.device, dtype: torch.dtype, ceilings: dict, timer: Timer) -> list[dict]:
    rows = []
    shape = plan.shape
    for seq_len, chunk in plan.prefill:
        query, k_cache, v_cache, meta = random_paged_batch(
            [(seq_len - chunk, chunk)], shape.heads, shape.kv_heads, shape.head_dim, plan.block_size, dtype, device)
        ops, scale = TritonOps(**plan.ops_settings), shape.head_dim**-0.5
        meta = ops.plan(meta, k_cache, shape.heads, dtype)  # once per step in the engine: outside the timing
        triton_ms = timer(partial(ops.attention, query, k_cache, v_cache, meta, scale))
        block_m = meta.plan.block_m

        # The same work on contiguous tensors, KV heads expanded: flash when the chunk is the whole
        # sequence, else a bottom-right-aligned causal mask (the chunk sits at the end of its context).
        q = torch.randn(1, shape.heads, chunk, shape.head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, shape.heads, seq_len, shape.head_dim, dtype=dtype, device=device) for _ in range(2))
        square = chunk == seq_len
        mask = None if square else causal_lower_right(chunk, seq_len)
        sdpa_ms = timer(partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=square))

        pairs = chunk * (seq_len - chunk) + chunk * (chunk + 1) // 2
        tflops = 4 * shape.heads * shape.head_dim * pairs / triton_ms / 1e9
        rows.append({
            "seq_len": seq_len, "chunk": chunk, "block_m": block_m, "triton_ms": triton_ms, "tflops": tflops,
            "frac_matmul_peak": tflops / ceilings["matmul_tflops"], "sdpa": "flash causal" if square else
            "causal_lower_right", "sdpa_ms": sdpa_ms, "speed_vs_sdpa": sdpa_ms / triton_ms,
        })
        del query, k_cache, v_cache, q, k, v
    return rows


def bench_decode(plan: Plan, device: torch.device, dtype: torch.dtype, ceilings: dict, timer: Timer,
                 kv_dtype: torch.dtype | None = None) -> list[dict]:
    """Decode attention as the engine's graphs replay it: the grid planned for `graph_max_positions`,
    each context split on the device. `kv_dtype` (an FP8 dtype): the pool in it, GB/s counting its bytes, and each
    row's largest difference from the torch path over the same pool widened (`max_err`)."""
    rows = []
    shape = plan.shape
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            if batch * context > plan.max_decode_tokens:
                continue
            query, k_cache, v_cache, meta = random_paged_batch(
                [(context - 1, 1)] * batch, shape.heads, shape.kv_heads, shape.head_dim, plan.block_size, dtype,
                device)
            meta.seq_lens_host = [plan.graph_max_positions] * batch
            ops, scale = TritonOps(**plan.ops_settings), shape.head_dim**-0.5
            checked = {}
            if kv_dtype is not None:
                k_cache, v_cache = to_cache(k_cache, kv_dtype), to_cache(v_cache, kv_dtype)
                true_meta = replace(meta, seq_lens_host=[context] * batch)
                got = ops.attention(query, k_cache, v_cache, true_meta, scale).float()
                want = TorchOps().attention(query.float(), k_cache.float(), v_cache.float(), true_meta, scale)
                checked = {"max_err": (got - want).abs().max().item()}
            triton_ms = timer(partial(ops.attention, query, k_cache, v_cache, meta, scale), graph=True)
            q = query.unsqueeze(2)  # [B, Hq, 1, D]
            k, v = (torch.randn(batch, shape.kv_heads, context, shape.head_dim, dtype=dtype, device=device)
                    for _ in range(2))
            sdpa_ms = timer(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True), graph=True)
            kv_bytes = 2 * batch * context * shape.kv_heads * shape.head_dim * k_cache.element_size()
            gbps = kv_bytes / triton_ms / 1e6
            rows.append({
                "batch": batch, "context": context, "grid_segments": ops.decode_segments(meta, shape.kv_heads),
                "triton_ms": triton_ms, "gbps": gbps, "frac_copy_bw": gbps / ceilings["copy_gbps"],
                "sdpa_ms": sdpa_ms, "speed_vs_sdpa": sdpa_ms / triton_ms, **checked,
            })
            del query, k_cache, v_cache, q, k, v
    return rows


def shared_prefix_batch(layout: SharedLayout, shape: Shape, block: int, dtype: torch.dtype, device: torch.device,
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, k_cache, v_cache, meta) of one decode step in `layout`: each group's prefix blocks held once in
    the pool (as the prefix cache holds them), each sequence's own blocks after them; `meta` carries the host
    tables."""
    if layout.shared % block:
        raise ValueError(f"the shared prefix ({layout.shared}) must be whole blocks of {block}")
    batch = layout.groups * layout.members
    own = 20 + (np.arange(batch) * 7) % 21  # tokens after the prefix, the query's included
    seq_lens = layout.shared + own
    prefix_blocks = layout.shared // block
    own_blocks = -(-seq_lens // block) - prefix_blocks
    width = int(prefix_blocks + own_blocks.max())
    tables = np.zeros((batch, width), dtype=np.int32)
    group = np.arange(batch) // layout.members
    tables[:, :prefix_blocks] = group[:, None] * prefix_blocks + np.arange(prefix_blocks)
    next_block = layout.groups * prefix_blocks
    for row, count in enumerate(own_blocks.tolist()):
        tables[row, prefix_blocks : prefix_blocks + count] = next_block + np.arange(count)
        next_block += count
    gen = torch.Generator(device).manual_seed(seed)
    cache_shape = (next_block, block, shape.kv_heads, shape.head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
    query = torch.randn(batch, shape.heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    positions = seq_lens - 1
    slots = tables[np.arange(batch), positions // block].astype(np.int64) * block + positions % block
    meta = AttentionMetadata(
        query_start=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(seq_lens).int().to(device), block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), query_lens_host=[1] * batch,
        seq_lens_host=seq_lens.tolist(), block_tables_host=tables,
    )
    return query, k_cache, v_cache, meta


def graph_groups(ops: TritonOps, meta: AttentionMetadata, shape: Shape, block: int) -> DecodeGroups:
    """The step's decode groups as the padded decode stages them: a fixed grid of batch // 2 group slots on the
    device, the unused ones empty."""
    batch = meta.num_seqs
    found = ops.group_decodes(np.asarray(meta.seq_lens_host), meta.block_tables_host, block,
                              shape.heads // shape.kv_heads)
    slots = np.zeros((max(1, batch // 2), 4), dtype=np.int32)
    slots[: len(found.groups)] = found.groups
    members = np.zeros(batch, dtype=np.int32)
    members[: len(found.members)] = found.members
    device = meta.seq_lens.device
    return DecodeGroups(*(torch.from_numpy(a).to(device) for a in (slots, members, found.shared_lens)))


def bench_shared_decode(plan: Plan, device: torch.device, dtype: torch.dtype, ceilings: dict, timer: Timer
                        ) -> list[dict]:
    """Shared-prefix decode attention (kernels/triton/shared_decode.py) as the engine's graphs replay it (groups
    staged in fixed slots, grids planned for `graph_max_positions`), against the floor of its bytes (each group's
    prefix KV once plus every sequence's own, at the measured copy bandwidth) and against the ungrouped split-K
    decode on the same batch and the same physical blocks (what the engine ran before issue 38). `own_segments` 1
    is the fused path (the decode kernel merges the prefix slots itself, no merge launch)."""
    rows = []
    for name, shape in plan.shared_shapes:
        for layout in plan.shared_layouts:
            query, k_cache, v_cache, meta = shared_prefix_batch(layout, shape, plan.block_size, dtype, device)
            scale = shape.head_dim**-0.5
            padded = [plan.graph_max_positions] * meta.num_seqs
            ungrouped = replace(meta, seq_lens_host=padded, block_tables_host=None)
            old_ops = TritonOps(**plan.ops_settings)
            old_meta = old_ops.plan(ungrouped, k_cache, shape.heads, dtype)
            old_ms = timer(partial(old_ops.attention, query, k_cache, v_cache, old_meta, scale), graph=True)
            want = old_ops.attention(query, k_cache, v_cache, old_meta, scale)
            kv_row = 2 * shape.kv_heads * shape.head_dim * k_cache.element_size()  # K and V bytes of one token
            own_tokens = sum(meta.seq_lens_host) - meta.num_seqs * layout.shared
            floor_bytes = kv_row * (layout.groups * layout.shared + own_tokens)
            floor_ms = floor_bytes / ceilings["copy_gbps"] / 1e6
            for shared_rows in plan.shared_rows:
                ops = TritonOps(**plan.ops_settings, shared_rows=shared_rows)
                grouped = replace(ungrouped, decode_groups=graph_groups(ops, meta, shape, plan.block_size))
                grouped = ops.plan(grouped, k_cache, shape.heads, dtype)
                shared_ms = timer(partial(ops.attention, query, k_cache, v_cache, grouped, scale), graph=True)
                got = ops.attention(query, k_cache, v_cache, grouped, scale)
                rows.append({
                    "shape": name, "groups": layout.groups, "members": layout.members, "shared": layout.shared,
                    "own_mean": own_tokens / meta.num_seqs, "shared_rows": shared_rows,
                    "own_segments": grouped.plan.num_segments, "shared_ms": shared_ms,
                    "floor_ms": floor_ms, "x_floor": shared_ms / floor_ms, "ungrouped_ms": old_ms,
                    "speedup": old_ms / shared_ms, "max_err": (got.float() - want.float()).abs().max().item(),
                })
            del query, k_cache, v_cache, meta, ungrouped, old_meta
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    columns = list(rows[0])
    print("  ".join(f"{c:>18}" for c in columns))
    for row in rows:
        print("  ".join(f"{v:>18.4g}" if isinstance(v, float) else f"{v!s:>18}" for v in row.values()))


def judge_goals(prefill: list[dict], decode: list[dict], end_to_end: dict | None) -> dict[str, dict]:
    flash_rows = [r["speed_vs_sdpa"] for r in prefill if r["sdpa"] == "flash causal"]
    long_rows = [r["frac_copy_bw"] for r in decode if r["context"] >= DECODE_GOAL_CONTEXT]
    goals = {
        f"prefill >= {PREFILL_GOAL}x flash SDPA (worst square row)": (min(flash_rows, default=float("nan")),
                                                                      PREFILL_GOAL),
        f"decode >= {DECODE_GOAL:.0%} of copy bandwidth (worst row, context >= {DECODE_GOAL_CONTEXT})":
            (min(long_rows, default=float("nan")), DECODE_GOAL),
    }
    waits = [w["max_wait_frac"] for w in (end_to_end or {}).get("host_wait", {}).values() if "max_wait_frac" in w]
    goal = f"no end-to-end step waits on the host > {gpu_e2e.HOST_WAIT_GOAL:.0%} of it (worst step)"
    goals[goal] = (max(waits) if waits else float("nan"), gpu_e2e.HOST_WAIT_GOAL)
    result = {}
    print()
    for name, (value, threshold) in goals.items():
        met = value <= threshold if name == goal else value >= threshold  # False when no row qualifies (nan)
        result[name] = {"value": value, "met": met}
        print(f"goal {name}: {value:.3f} -> {'MET' if met else 'NOT MET'}")
    return result


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            for table in ("prefill", "decode"):
                if results.get(table):
                    writer = csv.DictWriter(f, fieldnames=["table", *results[table][0]])
                    writer.writeheader()
                    writer.writerows({"table": table, **row} for row in results[table])
    else:
        path.write_text(json.dumps(results, indent=2))


SECTIONS = ("kernel_checks", "graph_checks", "invariance", "ceilings", "prefill", "decode", "shared_decode",
            "decode_fp8", "moe", "end_to_end", "goals")  # what --only may name; without it every section runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_results.json"),
                        help="results file: .json, or .csv for the two tables")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1, to test this script")
    parser.add_argument("--only", help=f"a comma-separated subset of the sections: {','.join(SECTIONS)}")
    args = parser.parse_args()

    if args.smoke:
        plan, device = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        plan, device = Plan(), torch.device("cuda")
    else:
        sys.exit("no GPU: run with --smoke to test the script on the CPU")
    dtype = torch.bfloat16
    start = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}")
    results: dict = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"heads": plan.shape.heads, "kv_heads": plan.shape.kv_heads, "head_dim": plan.shape.head_dim,
                  "block_size": plan.block_size, "dtype": str(dtype)},
        "errors": {}, "seconds": {}, "checks": [],
    }

    chosen = set(args.only.split(",")) if args.only else None
    if chosen and chosen - set(SECTIONS):
        sys.exit(f"--only: unknown sections {sorted(chosen - set(SECTIONS))}; choose from {','.join(SECTIONS)}")

    def section(key: str, work: Callable[[], object]) -> object:
        """Run one part; a failure is recorded and printed, and the next part still runs."""
        if chosen is not None and key not in chosen:
            return None
        began = time.time()
        try:
            value = work()
            if value is not None:
                results[key] = value
        except Exception:  # noqa: BLE001 - one device run must report every part it can
            results["errors"][key] = traceback.format_exc()
            print(f"\n{key} FAILED:\n{results['errors'][key]}")
        results["seconds"][key] = round(time.time() - began, 1)
        write_results(args.out, results)
        return results.get(key)

    checker = Checker()
    results["checks"] = checker.rows  # filled as the checks run
    print("correctness against TorchOps (bf16):")
    section("kernel_checks", lambda: check_kernels(plan, device, dtype, checker))
    section("graph_checks", lambda: check_decode_graph(plan, device, dtype, checker))
    for row in section("invariance", lambda: gpu_invariance.run(args.smoke, device)) or []:
        if row["invariant"]:  # the default path's rows are for the record
            checker.rows.append({"check": f"batch-invariant {row['check']}", "max_err": row["max_diff"],
                                 "ok": row["differing"] == 0})
    results["check_failures"] = checker.failures
    timer = Timer(device)
    ceilings = section("ceilings", lambda: measure_ceilings(plan, device, timer))
    if ceilings:
        print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
        prefill = section("prefill", lambda: bench_prefill(plan, device, dtype, ceilings, timer))
        if prefill:
            print_table("prefill attention (one sequence, chunk at the end of its context; L2 flushed)", prefill)
        decode = section("decode", lambda: bench_decode(plan, device, dtype, ceilings, timer))
        if decode:
            print_table(f"decode attention (CUDA graph replay, grid planned for {plan.graph_max_positions} "
                        "positions as the engine's graphs are; GB/s counts K and V bytes read)", decode)
        shared = section("shared_decode", lambda: bench_shared_decode(plan, device, dtype, ceilings, timer))
        if shared:
            print_table("shared-prefix decode attention (CUDA graph replay; floor: each group's prefix KV once + "
                        "own KV at copy bandwidth; ungrouped: the split-K decode on the same blocks)", shared)
            results["check_failures"] += [f"shared decode {r['shape']} {r['groups']}x{r['members']} rows "
                                          f"{r['shared_rows']}" for r in shared if not r["max_err"] <= TOLERANCE]
        fp8 = section("decode_fp8", lambda: bench_decode(plan, device, dtype, ceilings, timer, torch.float8_e4m3fn))
        if fp8:
            print_table("decode attention over an FP8 (e4m3) pool: GB/s counts its bytes, speed_vs_sdpa is against "
                        "bf16 SDPA, max_err against the torch path on the widened pool", fp8)
    moe = section("moe", lambda: gpu_moe.run(args.smoke, device, lambda fn, _, graph=False: timer(fn, graph=graph)))
    if moe:
        print_table("fused MoE against the per-expert torch loop (bf16)", moe)
    timer.flush = None  # 256 MiB back before the end-to-end run
    end_to_end = section("end_to_end", lambda: gpu_e2e.run(args.smoke, device))
    section("goals", lambda: judge_goals(results.get("prefill") or [], results.get("decode") or [], end_to_end))
    write_results(args.out, results)
    print(f"\nwrote {args.out}; total {time.time() - start:.0f} s")
    if results["errors"] or results["check_failures"]:
        sys.exit(f"failed: {sorted(results['errors'])} {results['check_failures']}")


if __name__ == "__main__":
    main()
