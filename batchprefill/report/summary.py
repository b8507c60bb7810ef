"""The lines a person reads when a command ends: the run's summary (stderr) and the plan's report (stdout)."""

from __future__ import annotations

import sys
from pathlib import Path

from batchprefill.units import readable_bytes


def print_run_summary(job: dict, out: Path, figure: Path | None, precision: str, kv_pool: str) -> None:
    """The job's statistics row (report.stats.job_row) in a few sentences, the precision it ran in and why
    (`model.loader.dtype_choice`), its KV pool (`kv_pool`: tokens, element type, bytes a token), and where its
    files and figure are."""
    print(
        f"batchprefill: {job['num_requests']} requests ({job['num_errors']} errors) in {job['wall_seconds']:.1f} s, "
        f"in {precision}; {kv_pool}. "
        f"Of {job['prompt_tokens']} prompt tokens, {job['cached_tokens']} came from the prefix cache "
        f"({job['cache_hit_rate']:.1%}) and {job['computed_prompt_tokens']} were computed "
        f"({job['prefill_tokens_per_second']:.0f} tokens/s); {job['output_tokens']} tokens were generated "
        f"({job['output_tokens_per_second']:.1f} tokens/s). {job['evicted_blocks']} blocks were evicted and "
        f"{job['preemptions']} requests preempted. Results and statistics are in {out}."
        + (f"\nbatchprefill: the run at a glance: {figure}" if figure else ""),
        file=sys.stderr,
    )


def print_plan_summary(row: dict, link_gbps: float, out: Path) -> None:
    """A handful of lines a person reads before deciding to launch the run."""
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
        f"  wrote {out / 'plan.parquet'} and {out / 'plan.png'}"
    )
