"""The lines a person reads when a command ends: the run's summary (stderr) and the plan's report (stdout)."""

from __future__ import annotations

import sys
from pathlib import Path

from batchprefill.units import counted, readable_bytes


def print_run_summary(job: dict, out: Path, figure: Path | None, precision: str, kv_pool: str, sizes: str = "",
                      temporary: bool = False) -> None:
    """The job's statistics row (report.stats.job_row) in a few sentences, the precision it ran in and why
    (`model.loader.dtype_choice`), the step sizes engine.*=auto chose (`sizes`, "" when none was auto), its KV pool
    (`kv_pool`: tokens, element type, bytes a token), and where its files and figure are; a job in a temporary
    folder (the Python API without output.dir) names none, as the folder is gone when the call returns."""
    where = ("The results are returned; their temporary folder is removed." if temporary
             else f"Results and statistics are in {out}.")
    print(
        f"batchprefill: {counted(job['num_requests'], 'request')} ({counted(job['num_errors'], 'error')}) "
        f"in {job['wall_seconds']:.1f} s{startup_clause(job)}, "
        f"in {precision}{', with ' + sizes if sizes else ''}; {kv_pool}. "
        f"Of {job['prompt_tokens']} prompt tokens, {job['cached_tokens']} came from the prefix cache "
        f"({job['cache_hit_rate']:.1%}) and {job['computed_prompt_tokens']} were computed "
        f"({job['prefill_tokens_per_second']:.0f} tokens/s); {job['output_tokens']} tokens were generated "
        f"({job['output_tokens_per_second']:.1f} tokens/s). {job['evicted_blocks']} blocks were evicted and "
        f"{job['preemptions']} requests preempted. {where}"
        + (f"\nbatchprefill: the run at a glance: {figure}" if figure else ""),
        file=sys.stderr,
    )


def startup_clause(job: dict) -> str:
    """" (0.8 s preparing the input, 2.1 s loading, 2.3 s warming up)": the job's start-up (report.startup), warm-up
    named only where it ran (a GPU's compiles and captures); "" for a row without these figures."""
    if "prepare_seconds" not in job:
        return ""
    parts = [(job["prepare_seconds"], "preparing the input"), (job["load_seconds"], "loading"),
             (job["warm_up_seconds"], "warming up")]
    return " (" + ", ".join(f"{seconds:.1f} s {what}" for seconds, what in parts
                            if seconds or what != "warming up") + ")"


def print_plan_summary(row: dict, link_gbps: float, out: Path, precision: str = "") -> None:
    """A handful of lines a person reads before deciding to launch the run; `precision`: how the weights are
    held (pipeline.plan.MemoryFit)."""
    computed, without = row["ideal_computed_tokens"], row["computed_tokens_without_reuse"]
    with_flops, without_flops = row["prefill_flops_with_reuse"], row["prefill_flops_without_reuse"]
    ratio = f"{without / computed:.2f}x fewer" if computed else "nothing to compute"
    saved = 1 - with_flops / without_flops if without_flops else 0.0
    print(
        f"batchprefill plan: {row['requests']} requests ({row['error_rows']} error rows) in {row['groups']} "
        f"prefix groups, the largest of {row['largest_group']} requests"
        + (f"; each group runs one of {row['adapters']} LoRA adapters or the base model" if row.get("adapters") else "")
        + "\n"
        f"  prompt tokens to compute: {computed:,} with prefix reuse vs {without:,} without ({ratio})\n"
        f"  prefill FLOPs: {with_flops:.3g} with reuse vs {without_flops:.3g} without ({saved:.1%} saved)\n"
        f"  KV cache: {row['kv_bytes_per_token']:,} bytes per token, {readable_bytes(row['kv_bytes_total'])} "
        f"for all prompts\n"
        f"  mean KV transfer per request at {link_gbps:g} Gb/s: {row['kv_transfer_seconds_mean'] * 1e3:.3f} ms\n"
        + (f"  {memory_line(row, precision)}\n" if "weight_bytes" in row else "")
        + f"  wrote {out / 'plan.parquet'} and {out / 'plan.png'}"
    )


def memory_line(row: dict, precision: str) -> str:
    """Whether the weights and the least pool fit the device: "memory: 67.9 GiB of weights (FP8 linears, ...)
    + a KV pool of at least 2.50 GiB on a 131 GiB device: fits"."""
    weights, pool, device = row["weight_bytes"], row["min_pool_bytes"], row["device_memory_bytes"]
    held = f"{readable_bytes(weights)} of weights ({precision}) + a KV pool of at least {readable_bytes(pool)}"
    if device is None:
        return f"memory: {held}; the device's memory is unknown here: give plan.device_memory_gb to check the fit"
    verdict = "fits" if row["fits_device"] else "does NOT fit: choose a smaller precision or a larger device"
    return f"memory: {held} on a {readable_bytes(device)} device: {verdict}"
