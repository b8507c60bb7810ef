"""Numbers for people: a byte count in the largest binary unit that keeps it readable, a count with its noun in
the right number ("1 error", "2 errors"), and a value's type with its article ("an int", "a str")."""

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


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, plural unless the count is one: "1 error", "0 errors", "3 errors"."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


def a_type(value: object) -> str:
    """The type of `value` with its article: "an int", "a str", "a NoneType"."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
