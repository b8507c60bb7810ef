"""`stats/run.png`: a job at a glance, drawn from the statistics a run (or `batchprefill-merge`) just wrote.

Four panels, each answering one question a user asks after a job:
- did prefix sharing pay? The running cache hit rate over the steps, beside the job's final rate and the rate
  an ideal cache would reach in this run order at this block size (`ideal_cached_tokens`, the plan's arithmetic);
- was the pool big enough? The active, reclaimable and free blocks stacked over the steps, with the steps that
  evicted cached blocks or preempted requests marked;
- where did the step budget go? Decode and prefill query tokens per step against `engine.max_batched_tokens`,
  with each step's duration;
- which groups paid? Requests per prefix group against the prompt tokens the cache served it.

A merged array's steps carry a `shard` column: the shards' steps are drawn one after another, shard by shard,
and their running totals are carried across. Steps are averaged into at most `MAX_STEP_POINTS` bins and at most
`MAX_GROUP_POINTS` groups are drawn, so the figure costs about the same for a million steps as for a hundred.
Drawing is a report, not part of the job: `write_run_figure` turns any failure into one warning line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.io.atomic import save_png
from batchprefill.units import counted

if TYPE_CHECKING:
    from matplotlib.axes import Axes

FIGURE_NAME = "run.png"
MAX_STEP_POINTS = 2000  # bins along the step axis: a 1100-pixel-wide panel shows no more
MAX_GROUP_POINTS = 5000  # groups drawn: past this a scatter is one blot
RUNNING_TOTALS = ("evicted_blocks", "preemptions", "finished_prompt_tokens", "finished_cached_tokens")
# Stacked panels are data from edge to edge: their legend goes into headroom above the data, in a band this high.
HEADROOM = 1.4
LEGEND = {"loc": "upper center", "ncols": 3, "fontsize": "small", "framealpha": 0.9}
PER_STEP = ("num_decode_tokens", "num_prefill_tokens", "active_blocks", "reclaimable_blocks", "free_blocks",
            "duration_ms")


def write_run_figure(stats: Path, command: str) -> Path | None:
    """Draw `stats/run.png`; returns its path, or None after printing one warning line if drawing failed.

    Any exception is caught on purpose: the results and statistics are already written, and a broken or
    unwritable figure must not turn a finished job into a failed one.
    """
    path = stats / FIGURE_NAME
    try:
        draw_run(stats, path)
    except Exception as error:  # noqa: BLE001 - see the docstring
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"{command}: warning: could not draw {path} ({reason}); the job's results and statistics are "
              "unaffected", file=sys.stderr)
        return None
    return path


@dataclass
class BinnedSteps:
    """The steps of a run averaged into bins of `width` consecutive steps (the last bin may be shorter)."""

    first_step: np.ndarray  # the first step of each bin, counted across shards
    width: int
    sizes: np.ndarray  # steps in each bin
    mean: dict[str, np.ndarray]  # per-step columns, averaged over each bin
    total: dict[str, np.ndarray]  # running totals across shards, at the end of each bin
    happened: dict[str, np.ndarray]  # whether the running total grew within the bin
    shard_starts: np.ndarray  # first step of each shard after the first


def bin_steps(steps: pa.Table, max_points: int = MAX_STEP_POINTS) -> BinnedSteps:
    """Average a steps table into at most `max_points` bins; running totals restart per shard in the table and
    are carried across shards here, so the last bin's totals are the whole job's."""
    count = steps.num_rows
    width = max(1, -(-count // max_points))
    edges = np.arange(0, count, width)
    sizes = np.diff(np.append(edges, count))
    if "shard" in steps.column_names:
        shard = steps["shard"].to_numpy()
        shard_starts = np.flatnonzero(shard[1:] != shard[:-1]) + 1
    else:
        shard_starts = np.array([], dtype=np.int64)
    mean = {name: np.add.reduceat(steps[name].to_numpy().astype(np.float64), edges) / sizes
            for name in PER_STEP if name in steps.column_names}
    total, happened = {}, {}
    for name in RUNNING_TOTALS:
        if name not in steps.column_names:
            continue
        running = steps[name].to_numpy().astype(np.int64)
        growth = np.diff(running, prepend=0)
        growth[shard_starts] = running[shard_starts]  # each shard's totals start from zero
        total[name] = np.cumsum(growth)[np.append(edges[1:], count) - 1]
        happened[name] = np.add.reduceat(growth, edges) > 0
    return BinnedSteps(edges, width, sizes, mean, total, happened, shard_starts)


def draw_run(stats: Path, path: Path) -> None:
    """The four panels from `stats/job.parquet`, `steps.parquet` and `groups.parquet`, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    job = pq.read_table(stats / "job.parquet").to_pylist()[0]
    steps = pq.read_table(stats / "steps.parquet")
    bins = bin_steps(steps) if steps.num_rows else None
    group_file = stats / "groups.parquet"
    groups = pq.read_table(group_file) if group_file.exists() else pa.table({})
    figure, axes = plt.subplots(2, 2, figsize=(15, 9), layout="constrained")
    try:
        _hit_rate(axes[0, 0], bins, job)
        _blocks(axes[0, 1], bins)
        _budget(axes[1, 0], bins, job)
        _groups(axes[1, 1], groups)
        shards = f" in {job['num_shards']} shards" if job.get("num_shards") else ""
        tally = f"{counted(job['num_requests'], 'request')} ({counted(job['num_errors'], 'error')})"
        figure.suptitle(f"batchprefill run: {tally}{shards}, "
                        f"{steps.num_rows:,} engine steps, {job['wall_seconds']:.1f} s")
        save_png(figure, path)
    finally:
        plt.close(figure)


def _step_axis(ax: Axes, bins: BinnedSteps) -> None:
    """Label the step axis and draw each shard boundary of a merged array."""
    merged = " (shards one after another)" if bins.shard_starts.size else ""
    averaged = f"; each point the mean of {bins.width:,} steps" if bins.width > 1 else ""
    ax.set_xlabel(f"engine step{merged}{averaged}")
    ax.set_xlim(0, max(int(bins.first_step[-1]) + bins.width - 1, 1))
    ax.xaxis.set_major_formatter("{x:,.0f}")
    for start in bins.shard_starts[:100]:  # past a hundred shards the lines only grey the panel
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
    ax.grid(alpha=0.3)


def _no_steps(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no engine steps in this run", ha="center", va="center", transform=ax.transAxes)


def _hit_rate(ax: Axes, bins: BinnedSteps | None, job: dict) -> None:
    prompt = job["prompt_tokens"]
    final = job["cache_hit_rate"]
    ideal = job.get("ideal_cached_tokens")
    ideal_rate = ideal / prompt if ideal is not None and prompt else None
    title = f"Prompt tokens served by the prefix cache: {final:.1%}"
    title += f" (ideal {ideal_rate:.1%})" if ideal_rate is not None else ""
    if bins is None:
        _no_steps(ax, title)
        return
    if "finished_prompt_tokens" in bins.total:
        done = bins.total["finished_prompt_tokens"]
        with np.errstate(invalid="ignore", divide="ignore"):
            running = np.where(done > 0, bins.total["finished_cached_tokens"] / done, np.nan)
        ax.plot(bins.first_step, running, color="tab:blue", label="running, over requests finished so far")
    # wide and pale beneath the dashed ideal, so both show where a run reaches the ideal
    ax.axhline(final, color="tab:green", linewidth=4, alpha=0.5, label=f"this job: {final:.1%}")
    if ideal_rate is not None:
        ax.axhline(ideal_rate, color="black", linestyle="--", label=f"ideal cache in this order: {ideal_rate:.1%}")
    ax.set(ylabel="cache hit rate (cached / prompt tokens)", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right", fontsize="small")
    _step_axis(ax, bins)


def _blocks(ax: Axes, bins: BinnedSteps | None) -> None:
    title = "KV blocks (reclaimable: cached, unreferenced); marks: steps that evicted or preempted"
    if bins is None:
        _no_steps(ax, title)
        return
    buckets = [("active_blocks", "active", "tab:red"), ("reclaimable_blocks", "reclaimable", "tab:orange"),
               ("free_blocks", "free", "tab:green")]
    ax.stackplot(bins.first_step, *(bins.mean[name] for name, _, _ in buckets),
                 labels=[label for _, label, _ in buckets], colors=[color for _, _, color in buckets], alpha=0.75,
                 step="post")
    pool = max(float(sum(bins.mean[name] for name, _, _ in buckets).max()), 1.0)
    marks = [("evicted_blocks", "evicted blocks", "|", "black", 1.04),
             ("preemptions", "preemptions", "v", "purple", 1.1)]
    for name, what, marker, color, height in marks:
        if name not in bins.total:
            continue
        where = bins.first_step[bins.happened[name]]
        ax.scatter(where, np.full(where.size, pool * height), marker=marker, color=color, s=30, clip_on=False,
                   label=f"{bins.total[name][-1]:,} {what}")
    ax.set(ylabel="blocks", ylim=(0, pool * HEADROOM), title=title)
    ax.legend(**LEGEND)
    _step_axis(ax, bins)


def _budget(ax: Axes, bins: BinnedSteps | None, job: dict) -> None:
    title = "Query tokens per step, decodes first"
    if bins is None:
        _no_steps(ax, title)
        return
    tokens = bins.mean["num_decode_tokens"] + bins.mean["num_prefill_tokens"]
    budget = job.get("max_batched_tokens")
    if budget:
        title += f": {np.average(tokens, weights=bins.sizes) / budget:.1%} of the budget used"
    ax.stackplot(bins.first_step, bins.mean["num_decode_tokens"], bins.mean["num_prefill_tokens"],
                 labels=["decode", "prefill"], colors=["tab:purple", "tab:cyan"], alpha=0.75, step="post")
    if budget:
        ax.axhline(budget, color="black", linestyle="--", label=f"engine.max_batched_tokens = {budget:,}")
    ax.set(ylabel="query tokens per step", title=title, ylim=(0, max(float(tokens.max()), budget or 0, 1) * HEADROOM))
    duration = ax.twinx()
    duration.plot(bins.first_step, bins.mean["duration_ms"], color="tab:brown", linewidth=0.9,
                  label="step duration (right axis)")
    duration.set(ylabel="step duration (ms)", ylim=(0, max(float(bins.mean["duration_ms"].max()), 1e-3) * HEADROOM))
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = duration.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, **{**LEGEND, "ncols": 2})
    _step_axis(ax, bins)


def _groups(ax: Axes, groups: pa.Table) -> None:
    """One marker per distinct (requests, tokens saved) pair, its area growing with the log of the groups at it: the
    groups of a templated dataset often coincide, and a plain scatter would show eight such groups as one."""
    from matplotlib.ticker import MaxNLocator

    count = groups.num_rows
    if not count:
        ax.set_title("Prefix groups")
        ax.text(0.5, 0.5, "no prefix groups in this run", ha="center", va="center", transform=ax.transAxes)
        return
    sizes = groups["num_requests"].to_numpy()
    saved = groups["cached_tokens"].to_numpy()
    points, where, repeats = np.unique(np.stack([sizes, saved], axis=1), axis=0, return_inverse=True,
                                       return_counts=True)
    prompt = np.bincount(where.reshape(-1), weights=groups["prompt_tokens"].to_numpy(), minlength=len(points))
    shown = _group_sample(points[:, 1], MAX_GROUP_POINTS)
    x, y, many = points[shown, 0], points[shown, 1], repeats[shown]
    drawn = ax.scatter(x, y, c=y * many / np.maximum(prompt[shown], 1), cmap="viridis", vmin=0, vmax=1,
                       s=20 + 30 * np.log10(many), alpha=0.85, edgecolors="black", linewidths=0.3)
    ax.figure.colorbar(drawn, ax=ax, label="the groups' own hit rate (cached / prompt tokens)")
    if shown.size <= 40:  # few enough to label: how many groups each marker stands for
        for px, py, n in zip(x, y, many):
            if n > 1:
                ax.annotate(f"{n:,} groups", (px, py), xytext=(6, 4), textcoords="offset points", fontsize="small")
    sample = f" ({shown.size:,} of {len(points):,} distinct points drawn)" if shown.size < len(points) else ""
    ax.set(xlabel="requests in the group", ylabel="prompt tokens served from the cache",
           title=f"Prefix groups: {count:,}{sample}; {int(saved.sum()):,} prompt tokens saved in all")
    if sizes.max() > 50 * max(sizes.min(), 1):
        ax.set_xscale("log")
    else:
        ax.set_xlim(0, sizes.max() * 1.1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if saved.max() > 1000 * max(saved[saved > 0].min(initial=saved.max()), 1):
        ax.set_yscale("symlog", linthresh=max(int(saved[saved > 0].min(initial=1)), 1))
    else:
        ax.set_ylim(0, max(saved.max(), 1) * 1.1)
        ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.grid(alpha=0.3)


def _group_sample(saved: np.ndarray, limit: int) -> np.ndarray:
    """Indexes of the points to draw: all of them, or the tenth of `limit` that saved most plus an even spread
    of the rest (deterministic, so two drawings of one run agree)."""
    if saved.size <= limit:
        return np.arange(saved.size)
    top = np.argsort(saved, kind="stable")[-(limit // 10):]
    rest = np.setdiff1d(np.arange(saved.size), top)
    spread = rest[np.linspace(0, rest.size - 1, limit - top.size).astype(np.int64)]
    return np.union1d(top, spread)
