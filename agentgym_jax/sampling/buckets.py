"""Shape buckets: pad batch, chunk and cache lengths up to a few fixed sizes.

Every distinct input shape costs one XLA compilation. Rounding sizes up to a short, fixed list
(powers of two, or with `threes` also 3 * 2^k between them) bounds the number of compilations, so
after warm-up a new batch size, prompt length or turn length inside a known bucket compiles nothing
new.
"""

from __future__ import annotations

from collections.abc import Sequence


def powers_of_two(minimum: int, maximum: int, *, threes: bool = False) -> tuple[int, ...]:
    """(minimum, 2*minimum, ...) below `maximum`, then `maximum` itself (the hard cap).

    `threes`: also 1.5x each size where that is a whole number (1, 2, 3, 4, 6, 8, 12, ...), so a
    size is padded by at most a third instead of a half (24 episodes run as 24 rows, not 32), for
    twice the shapes to compile.
    """
    if not 1 <= minimum <= maximum:
        raise ValueError(f"need 1 <= minimum <= maximum, got minimum={minimum}, maximum={maximum}")
    sizes = []
    size = minimum
    while size < maximum:
        sizes.append(size)
        if threes and size % 2 == 0 and size * 3 // 2 < maximum:
            sizes.append(size * 3 // 2)
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
