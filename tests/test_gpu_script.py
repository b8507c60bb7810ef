"""The GPU benchmark script that a session with a GPU runs must work: its --smoke mode runs every part
(correctness checks, kernel tables, end-to-end engine) at tiny sizes on the CPU under the interpreter."""

import json

from tests.conftest import REPO, run_cli


def test_gpu_benchmark_smoke_mode_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    done = run_cli(["python", str(REPO / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert {"prefill", "decode", "goals", "end_to_end", "ceilings", "moe"} <= set(results)
    assert [(row["tokens"], row["max_error"] < 2e-2) for row in results["moe"]] == [(1, True), (9, True)]
    on, off = results["end_to_end"]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] == on["prompt_tokens"]
    assert on["output_tokens"] == off["output_tokens"] == on["requests"] * 2
