"""The bfloat16 RMSNorm (with the residual add) of `kernels/native/elementwise.py` on one thread and on two, by rows.

    python benchmarks/cpu/norm_threads.py                          # this checkout's kernel
    PYTHONPATH=OTHER python benchmarks/cpu/norm_threads.py         # another checkout's (its csrc is built)

SmolLM2-135M's width (576 columns), the C++ call alone (its pointers prepared once). Two conditions: hot, the same
call repeated (its tensors in the caches); cold, each call after a 32 MB pass over other memory and a small matmul,
as a decode step's norms run between matmuls that stream the weights (the matmul also wakes the OpenMP threads,
as in a step). Microseconds a call, the mean of 300 calls (hot: 5,000). A build that splits a call across threads
only from some row count on runs the rows below it on one thread whatever `threads` says.
"""

from __future__ import annotations

import json
import time

import torch

from batchprefill.kernels.native.elementwise import load

COLS, ROWS = 576, (4, 8, 16, 32, 80, 160)


def main() -> None:
    torch.set_num_threads(2)
    kernels = load()
    norm = kernels._norm[torch.bfloat16]
    weight = torch.randn(COLS).bfloat16()
    flush = torch.randn(8 * 2**20)
    matmul = torch.ops.mkldnn._reorder_linear_weight(torch.randn(3072, COLS).bfloat16(), None)
    small = torch.randn(8, COLS).bfloat16()
    results = {}
    for rows in ROWS:
        x, residual = torch.randn(rows, COLS).bfloat16(), torch.randn(rows, COLS).bfloat16()
        normed, total = torch.empty_like(x), torch.empty_like(x)
        row = {}
        for threads in (1, 2):
            arguments = (x.data_ptr(), COLS, residual.data_ptr(), COLS, weight.data_ptr(), rows, COLS, 1e-5,
                         normed.data_ptr(), total.data_ptr(), threads)
            for _ in range(100):
                norm(*arguments)
            began = time.perf_counter()
            for _ in range(5000):
                norm(*arguments)
            row[f"hot_{threads}"] = (time.perf_counter() - began) / 5000 * 1e6
            seconds = 0.0
            for _ in range(300):
                flush.add_(1.0)
                torch.ops.mkldnn._linear_pointwise(small, matmul, None, "none", [], "")
                began = time.perf_counter()
                norm(*arguments)
                seconds += time.perf_counter() - began
            row[f"cold_{threads}"] = seconds / 300 * 1e6
        results[rows] = {key: round(value, 1) for key, value in row.items()}
        print(f"{rows:4d} rows: hot {row['hot_1']:.1f} / {row['hot_2']:.1f} us (1 / 2 threads), cold "
              f"{row['cold_1']:.1f} / {row['cold_2']:.1f} us ({row['cold_2'] / row['cold_1']:.2f}x)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
