"""Shape buckets: pad batch, chunk and cache lengths up to a few fixed sizes.

Every distinct input shape costs one XLA compilation. Rounding sizes up to a short, fixed list
(powers of two by default) bounds the number of compilations, so after warm-up a new batch size,
prompt length or turn length inside a known bucket compiles nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence


def powers_of_two(minimum: int, maximum: int) -> tuple[int, ...]:
    """(minimum, 2*minimum, ...) below `maximum`, then `maximum` itself (the hard cap)."""
    if not 1 <= minimum <= maximum:
        raise ValueError(f"need 1 <= minimum <= maximum, got minimum={minimum}, maximum={maximum}")
    sizes = []
    size = minimum
    while size < maximum:
        sizes.append(size)
        size *= 2
    return (*sizes, maximum)


def check_buckets(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
    """Validates a bucket list: positive, strictly increasing integers."""
    sizes = tuple(int(s) for s in sizes)
    if not sizes or sizes[0] < 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"{name} must be positive and strictly increasing, got {sizes}")
    return sizes


def bucket(n: int, sizes: Sequence[int], what: str = "size") -> int:
    """The smallest bucket >= n; a clear error when n exceeds the largest one."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]} (buckets: {tuple(sizes)})")
