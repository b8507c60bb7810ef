"""The CPU path's two hot spots, each side by side with the plain torch call it replaced, in one run.

    python benchmarks/cpu/cpu_ops.py                      # SmolLM2-135M's shapes, 2 threads
    python benchmarks/cpu/cpu_ops.py --out benchmarks/results/cpu_ops.json

1. Linear layers: `F.linear` (the BLAS re-packs the weight on every call) against `Linear`, whose weight
   oneDNN reordered once at load. Shapes: the fused QKV, O, gate+up and down projections and the LM head,
   at 1 token, a 96-row decode batch and a 2048-token prefill step.
2. A long chunk after a cached prefix (chunked prefill of a long prompt): the prefix and the causal chunk as
   two fused calls merged by log-sum-exp, against one call under a mask.
3. Decode attention with shared prefixes: 96 decodes in 24 groups of 4 (a 400-token prefix shared by each
   group, 40 own tokens each), through shared-prefix group attention against each sequence gathering its
   whole context into one padded fused call (what the torch path did before prefix groups).
4. Decode attention with short and long answers: 81 decodes in 9 groups of 9 (a 400-token prefix each, 40 or
   450 own tokens), each decode's own blocks read in place by the C++ kernel (`kernels/native/paged_decode.py`)
   against gathered into a padded copy before one fused call (the torch path before the kernel). Since session
   5 both are one C++ call per layer (shared prefix and own blocks in one online softmax) against the gathered
   path and its log-sum-exp merge in torch.
5. RMSNorm with the residual add, and RoPE of queries and keys, at an 80-row decode step: one C++ pass per row
   (`kernels/native/elementwise.py`) against the torch ops, each call after the caches were flushed by a 64 MB
   pass, as they are between a step's weight-streaming matmuls. The gated MLP's silu(gate) * up likewise, in float32
   and bfloat16, with its input in the caches (the gate and up projection has just written it).

`--only elementwise` (or a comma list of linear, chunk, attention, elementwise) runs those parts alone.

Times are medians of repeated calls after warm-up; ratios are what carry to other machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchprefill import malloc
from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.linear import Linear
from batchprefill.kernels.native import elementwise as native_elementwise
from batchprefill.kernels.torch import elementwise as torch_elementwise
from batchprefill.kernels.torch.ops import TorchOps, _cached_then_causal

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 49152, 9, 3, 64
PROJECTIONS = {"qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
               "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE), "lm_head": (VOCAB, HIDDEN)}


def median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def linear_rows(repeat: int) -> list[dict]:
    rows = []
    for tokens in (1, 96, 2048):
        for name, (out_features, in_features) in PROJECTIONS.items():
            if name == "lm_head" and tokens == 2048:
                continue  # logits are computed only for the rows that sample
            weight = torch.randn(out_features, in_features) / in_features**0.5
            x = torch.randn(tokens, in_features)
            packed = Linear(weight)
            plain = median_ms(lambda: F.linear(x, weight), repeat)  # noqa: B023
            ours = median_ms(lambda: packed(x), repeat)  # noqa: B023
            flops = 2 * tokens * out_features * in_features
            rows.append({"op": f"linear {name}", "tokens": tokens, "baseline_ms": plain, "ours_ms": ours,
                         "speedup": plain / ours, "ours_gflops": flops / ours / 1e6})
    return rows


def decode_batch(groups: int = 24, members: int = 4, prefix: int = 400, own: int = 40, block: int = 16):
    """A decode step of prefix groups over a random KV cache: (query, k_cache, v_cache, meta)."""
    generator = torch.Generator().manual_seed(0)
    prefix_blocks, own_blocks = cdiv(prefix, block), cdiv(own, block)
    num_blocks = groups * (prefix_blocks + members * own_blocks) + 1
    k_cache = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=generator)
    tables, next_block = [], 1
    for _ in range(groups):
        shared = list(range(next_block, next_block + prefix_blocks))
        next_block += prefix_blocks
        for _ in range(members):
            tables.append(shared + list(range(next_block, next_block + own_blocks)))
            next_block += own_blocks
    seq_lens = [prefix_blocks * block + own] * len(tables)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        query_start=torch.arange(len(tables) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(len(tables), dtype=torch.int64), query_lens_host=[1] * len(tables),
        seq_lens_host=seq_lens)
    query = torch.randn(len(tables), HEADS, HEAD_DIM, generator=generator)
    return query, k_cache, v_cache, meta


def padded_per_sequence(query, k_cache, v_cache, meta, scale):
    """The baseline: every decode gathers its whole context, all in one padded fused call."""
    block = k_cache.shape[1]
    span = max(meta.seq_lens_host)
    blocks = meta.block_tables[:, : cdiv(span, block)].long()
    keys = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [S, Hkv, L, D]
    values = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    visible = torch.arange(keys.shape[2])[None, :] < meta.seq_lens.long()[:, None]
    return F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=visible[:, None, None],
                                          scale=scale, enable_gqa=True)[:, :, 0]


def attention_rows(repeat: int) -> list[dict]:
    query, k_cache, v_cache, meta = decode_batch()
    scale = HEAD_DIM**-0.5
    ops = TorchOps()
    ours_out, base_out = ops.attention(query, k_cache, v_cache, meta, scale), padded_per_sequence(
        query, k_cache, v_cache, meta, scale)
    assert torch.allclose(ours_out, base_out, atol=1e-4), "group attention disagrees with the baseline"
    plain = median_ms(lambda: padded_per_sequence(query, k_cache, v_cache, meta, scale), repeat)
    ours = median_ms(lambda: ops.attention(query, k_cache, v_cache, meta, scale), repeat)  # plan cached per step
    rows = [{"op": "decode attention, 24 groups x 4", "tokens": meta.num_seqs, "baseline_ms": plain, "ours_ms": ours,
             "speedup": plain / ours, "ours_gflops": None}]
    # long answers: each decode's own blocks read in place by the C++ kernel against gathered into a padded copy
    gathering = TorchOps(native=False)
    for own in (40, 450):
        query, k_cache, v_cache, meta = decode_batch(groups=9, members=9, prefix=400, own=own)
        # each backend's own plan, built once per step (not timed): the kernel's sets, or the gathered batches
        plan, gathered_plan = (o.plan(meta, k_cache, HEADS, query.dtype) for o in (ops, gathering))
        in_place = ops.attention(query, k_cache, v_cache, plan, scale)
        assert torch.allclose(in_place, gathering.attention(query, k_cache, v_cache, gathered_plan, scale), atol=1e-4)
        plain = median_ms(lambda: gathering.attention(query, k_cache, v_cache, gathered_plan, scale), repeat)  # noqa: B023
        ours = median_ms(lambda: ops.attention(query, k_cache, v_cache, plan, scale), repeat)  # noqa: B023
        rows.append({"op": f"decode attention, 9 groups x 9, 400 shared + {own} own tokens (in place vs gathered)",
                     "tokens": meta.num_seqs, "baseline_ms": plain, "ours_ms": ours, "speedup": plain / ours,
                     "ours_gflops": None})
    return rows


def chunk_rows(repeat: int) -> list[dict]:
    rows = []
    for new, cached in ((768, 256), (2048, 1000), (2048, 4096)):
        generator = torch.Generator().manual_seed(new + cached)
        q = torch.randn(1, HEADS, new, HEAD_DIM, generator=generator)
        keys = torch.randn(1, KV_HEADS, new + cached, HEAD_DIM, generator=generator)
        values = torch.randn(1, KV_HEADS, new + cached, HEAD_DIM, generator=generator)
        visible = torch.arange(new + cached)[None, :] <= torch.arange(cached, cached + new)[:, None]
        scale = HEAD_DIM**-0.5

        def masked():
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,  # noqa: B023
                                                  enable_gqa=True)

        def split():
            return _cached_then_causal(q, keys, values, cached, scale)  # noqa: B023

        assert torch.allclose(masked(), split(), atol=1e-4), "split attention disagrees with the masked call"
        plain, ours = median_ms(masked, repeat), median_ms(split, repeat)
        rows.append({"op": f"chunk attention after {cached} cached", "tokens": new, "baseline_ms": plain,
                     "ours_ms": ours, "speedup": plain / ours, "ours_gflops": None})
    return rows


def cold_median_ms(fn, repeat: int) -> float:
    """Median time of `fn` right after a 64 MB pass has pushed its inputs and outputs out of the caches."""
    flush = torch.zeros(16 << 20)
    times = []
    for _ in range(repeat + 3):
        flush.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def elementwise_rows(repeat: int) -> list[dict]:
    kernels = native_elementwise.load()
    if kernels is None:
        return []
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(80, HIDDEN, generator=generator), torch.randn(80, HIDDEN, generator=generator)
    weight = torch.randn(HIDDEN, generator=generator)
    qkv = torch.randn(80, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    q = qkv[:, : HEADS * HEAD_DIM].view(80, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(80, KV_HEADS, HEAD_DIM)
    positions, table = torch.randint(0, 900, (80,), generator=generator), torch.randn(8192, HEAD_DIM)
    cases = {"RMSNorm + residual add": (lambda o: o.rms_norm(x, weight, 1e-5, residual)),
             "RoPE q and k": (lambda o: o.rope(q, k, positions, table))}
    rows = []
    for name, call in cases.items():
        plain = cold_median_ms(lambda: call(torch_elementwise), repeat)  # noqa: B023
        ours = cold_median_ms(lambda: call(kernels), repeat)  # noqa: B023
        rows.append({"op": f"{name}, caches flushed", "tokens": 80, "baseline_ms": plain, "ours_ms": ours,
                     "speedup": plain / ours, "ours_gflops": None})
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = torch.randn(80, 2 * INTERMEDIATE, generator=generator).to(dtype)
        plain = median_ms(lambda: torch_elementwise.gated_activation(gate_up, "silu"), repeat)  # noqa: B023
        ours = median_ms(lambda: kernels.gated_activation(gate_up, "silu"), repeat)  # noqa: B023
        rows.append({"op": f"silu(gate) * up, {str(dtype).removeprefix('torch.')}", "tokens": 80,
                     "baseline_ms": plain, "ours_ms": ours, "speedup": plain / ours, "ours_gflops": None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--only", default="linear,chunk,attention,elementwise", help="a comma list of parts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    malloc.keep_freed_memory()
    torch.set_num_threads(args.threads)
    parts = {"linear": lambda: linear_rows(args.repeat), "chunk": lambda: chunk_rows(max(5, args.repeat // 3)),
             "attention": lambda: attention_rows(args.repeat), "elementwise": lambda: elementwise_rows(args.repeat)}
    with torch.inference_mode():
        rows = [row for part in args.only.split(",") for row in parts[part]()]
    print("| op | tokens | baseline ms | ours ms | speedup | ours GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        gflops = f"{row['ours_gflops']:.0f}" if row["ours_gflops"] else ""
        print(f"| {row['op']} | {row['tokens']} | {row['baseline_ms']:.3f} | {row['ours_ms']:.3f} | "
              f"{row['speedup']:.2f} | {gflops} |")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
