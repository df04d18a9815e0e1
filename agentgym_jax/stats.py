"""Statistics every report shares (evaluation, the RL job's before/after table)."""

from __future__ import annotations

import math

WILSON_Z = 1.959964  # two-sided 95% normal quantile


def wilson_interval(successes: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion `successes / n` (n > 0)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes} / {n}")
    p = successes / n
    z2 = z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends at 0/n and n/n
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high
