"""`plan.png`: how deep the job's prompts share a prefix, and how its prefix groups spread, before any run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from batchprefill.io.atomic import save_png


def draw_plan(row: dict, depths: Counter, group_sizes: Counter, block_size: int, path: Path) -> None:
    """Left: how much of the dataset each depth of the prefix tree shares. Right: the spread of group sizes.

    `row` is the plan's row (its request and prompt token counts); `depths` maps full blocks shared with another
    prompt to requests, `group_sizes` a group size to its number of groups (the plan's tally)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    deepest = max(depths, default=0)
    shown = list(range(1, deepest + 1))
    at_least = [sum(n for d, n in depths.items() if d >= depth) / max(row["requests"], 1) for depth in shown]
    left.bar(shown, at_least, width=0.85, color="tab:blue")
    left.set(xlabel=f"prefix depth (full blocks of {block_size} tokens)",
             ylabel="fraction of requests sharing at least this deep", ylim=(0, 1.02),
             title="How deep prompts share a prefix with another prompt")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.grid(alpha=0.3, axis="y")
    if not shown:
        left.text(0.5, 0.5, "no request shares a full block", ha="center", va="center", transform=left.transAxes)

    sizes = sorted(group_sizes.elements())
    largest = max(sizes, default=1)
    right.hist(sizes, bins=_size_bins(largest), color="tab:orange", edgecolor="black", linewidth=0.5)
    right.set(xlabel="requests in the group", ylabel="groups",
              title=f"Group sizes: {len(sizes)} groups, largest {largest}")
    if largest > 64:
        right.set_xscale("log")
    else:
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    if group_sizes and max(group_sizes.values()) > 50 * min(group_sizes.values()):
        right.set_yscale("log")
    right.grid(alpha=0.3, axis="y")
    figure.suptitle(f"batchprefill plan: {row['requests']} requests, {row['prompt_tokens']} prompt tokens")
    save_png(figure, path)
    plt.close(figure)


def _size_bins(largest: int) -> list[float]:
    """One bar per size while sizes are few, else bins that double in width (read on a log axis)."""
    if largest <= 64:
        return [size - 0.5 for size in range(1, largest + 2)]
    edges, edge = [], 1.0
    while edge <= largest:
        edges.append(edge)
        edge *= 2
    return [*edges, edge]
