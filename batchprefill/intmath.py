"""Integer arithmetic the block-based code needs everywhere."""


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: the blocks of `denominator` slots that hold `numerator` items."""
    return -(-numerator // denominator)
