"""The GPU benchmark script that a session with a GPU runs must work: its --smoke mode runs every part
(correctness checks, kernel tables, end-to-end engine) at tiny sizes on the CPU under the interpreter, and
its Slurm wrapper runs from any folder."""

import ast
import json
import shutil

from tests.conftest import REPO, run_cli

NO_SLURM = {"BATCHPREFILL_REPO": "", "SLURM_JOB_ID": "", "SLURM_SUBMIT_DIR": ""}


def declared_sections() -> tuple[str, ...]:
    """gpu.py's SECTIONS, read from its source (importing it would import triton before the interpreter is set)."""
    tree = ast.parse((REPO / "benchmarks" / "gpu" / "gpu.py").read_text())
    value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "SECTIONS")
    return ast.literal_eval(value)


def test_gpu_benchmark_smoke_mode_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    done = run_cli(["python", str(REPO / "benchmarks" / "gpu" / "gpu.py"), "--smoke", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert {"prefill", "decode", "shared_decode", "decode_fp8", "goals", "end_to_end", "ceilings", "checks",
            "moe"} <= set(results)
    assert set(results["seconds"]) == set(declared_sections())  # every section ran, and --only can name each
    shared = results["shared_decode"]
    assert [(row["groups"], row["members"], row["max_err"] < 2e-2) for row in shared] == [(2, 3, True)]
    assert [(row["tokens"], row["max_error_vs_fp32"] < 5e-2) for row in results["moe"]] == [(1, True), (9, True)]
    assert results["errors"] == {} and results["check_failures"] == []
    checks = {c["check"] for c in results["checks"]}
    assert "batch-invariant padded decode vs unpadded" in checks
    assert any(c.startswith("padded decode vs float32") for c in checks)
    runs = results["end_to_end"]["runs"]
    assert [(r["prefix_caching"], r["repeat"]) for r in runs] == [(True, 1), (False, 1), (True, 2), (False, 2)]
    for on, off in (runs[:2], runs[2:]):
        assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] == on["prompt_tokens"]
        assert on["output_tokens"] == off["output_tokens"] == on["requests"] * 2


def test_the_fp8_benchmark_smoke_mode_times_five_ways_at_each_row_count_and_sweeps_six_widened_tiles(tmp_path):
    """gpu_fp8.py, the device session's second step: at the smoke's 1 and 3 rows every layer is checked and timed
    bf16, fp8, W8A8, widened and block-scaled, and the widened kernel's six tiles are timed at 1 row per layer."""
    out = tmp_path / "fp8.json"
    done = run_cli(["python", str(REPO / "benchmarks" / "gpu" / "gpu_fp8.py"), "--smoke", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [(row["tokens"], row["widens"]) for row in results["rows"]] == [(1, True), (3, True)]
    ways = {"bf16_ms", "fp8_ms", "fp8_w8a8_ms", "fp8_widened_ms", "fp8_block_ms"}
    for row in results["rows"]:
        assert set(row["layers"]) == {"qkv", "o", "gate_up", "down"}
        for layer in row["layers"].values():
            assert ways <= set(layer) and layer["error_vs_fp8_product"] < 0.02
    assert [(entry["tokens"], entry["layer"], len(entry["times_ms"])) for entry in results["sweep"]] == [
        (1, "qkv", 6), (1, "o", 6), (1, "gate_up", 6), (1, "down", 6)]


def test_the_prefill_tiles_benchmark_smoke_mode_prints_a_table_row_per_kind(tmp_path):
    out = tmp_path / "tiles.json"
    done = run_cli(["python", str(REPO / "benchmarks" / "gpu" / "gpu_prefill_tiles.py"), "--smoke", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["errors"] == {} and set(results["best"]) == {"32 from scratch", "32 after cached"}
    routed = [row for row in results["rows"] if row["config"] == "routed (sdpa per chunk)"]
    assert [(row["seq_len"], row["close_to_kernel"]) for row in routed] == [(32, True)]
    assert "HOPPER_PREFILL_TILES" in done.stdout and "    (32, True): (" in done.stdout


def test_the_slurm_wrapper_finds_the_repo_from_another_folder(tmp_path):
    done = run_cli(["bash", str(REPO / "jobs" / "gpu_benchmark.sh"), "--help"], cwd=tmp_path, env=NO_SLURM)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--smoke" in done.stdout


def test_a_copy_of_the_slurm_wrapper_outside_the_repo_fails_with_one_line(tmp_path):
    """sbatch runs a spooled copy: with no Slurm record and no BATCHPREFILL_REPO it must say what to set."""
    copy = tmp_path / "spool" / "job.sh"
    copy.parent.mkdir()
    shutil.copy(REPO / "jobs" / "gpu_benchmark.sh", copy)
    done = run_cli(["bash", str(copy), "--smoke"], cwd=tmp_path, env=NO_SLURM)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "BATCHPREFILL_REPO" in done.stderr
