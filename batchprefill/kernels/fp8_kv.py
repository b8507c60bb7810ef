"""FP8 KV caches (`engine.kv_cache_dtype=fp8`, `fp8_e4m3`, `fp8_e5m2`): K and V stored in 8 bits, read by every
attention path and widened to the compute dtype where they are read (in registers on a GPU, in the C++ walks' block
buffers on the CPU).

Scale: one per tensor, 1.0, as vLLM without calibration files: a stored element is the value itself rounded to
the nearest FP8 number (saturated at the largest, never infinity or NaN), so the pool needs no scales beside it and
a fork's copy, the prefix cache and every kernel see plain 8-bit tensors. Measured on the shipped SmolLM2-135M (4
chat prompts of 42-45 tokens, all 30 layers, float32 attention on the rounded K and V against the exact ones;
relative L2 error of the attention output, mean over layers / worst layer):

    e4m3, per tensor, scale 1.0            0.071 / 0.103
    e4m3, per tensor, calibrated (amax)    0.068 / 0.091
    e4m3, per token and head (amax)        0.055 / 0.081
    e5m2, per tensor, scale 1.0            0.137 / 0.208
    e5m2, per token and head (amax)        0.111 / 0.153

|K| reaches 9.7-20.7 and |V| 0.6-12.5 per layer, 20x inside e4m3's 448, so no value saturates; floating point
keeps its relative precision across the range, which is why finer scales gain little (0.071 -> 0.055) for a scale
per token and head that every kernel would have to load, and a calibrated per-tensor scale gains less. e5m2 has
one mantissa bit fewer and twice the error. So plain `fp8` means e4m3 (as vLLM on a GPU; its CPU backend picks
e5m2 because a float16 is one shift away), and e4m3 widens on the CPU nearly as cheaply: its 7 low bits shifted
into a float16's exponent and mantissa give the value / 256 exactly (subnormals too), so one mask, one shift, F16C
and a multiply. A model whose K or V exceed 448 (none measured here) saturates there; fp8_e5m2 reaches 57344.

Whole jobs on the shipped model (benchmarks/cpu/fp8_kv.py, BENCHMARKS.md): task=score picked the same best choice as the
model dtype's KV on 96 of 96 rows in bfloat16 and 95 of 96 in float32 (e5m2: 96 of 96, log-probabilities moving 3.6x
as far); greedy answers stayed the same for 24-29 of 64 tokens on average (e5m2: 10). The CPU's decode walks took
0.75-0.95x bfloat16's time on one core (instruction-bound there, not memory-bound), and attention about 0.85x a
decode step of a whole bfloat16 job on two.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the pool stores it: an FP8 pool's elements rounded to nearest, saturated at the format's largest
    (torch's cast gives e5m2 infinity past it); other pools' a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)
