"""Sizes for people: a byte count in the largest binary unit that keeps it readable."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
STEP = 1024


def readable_bytes(count: float) -> str:
    """`count` bytes in the largest unit it fills once, with about three significant digits: 2,233,382,961,152
    bytes are "2.03 TiB", not "2,129,920.0 MiB". TiB is the largest unit, so a petabyte reads "909 TiB"."""
    value, place = float(count), 0
    while place < len(UNITS) - 1 and round(abs(value)) >= STEP:
        value /= STEP
        place += 1
    if place == 0:
        return f"{round(value):,} B"
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{decimals}f} {UNITS[place]}"
