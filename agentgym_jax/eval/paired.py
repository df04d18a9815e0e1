"""Paired comparison of two evaluation runs on the same tasks.

Each task gives a pair (success rate of run A, success rate of run B) over its samples. A task is
a win for A, a loss, or a tie. Two tests of "A and B are equally good":
- exact McNemar: on the discordant tasks (wins + losses) the number of wins is Binomial(n, 1/2)
  under the null; two-sided p-value. With one sample per task this is McNemar's exact test; with
  several it is the sign test on per-task rates.
- paired bootstrap: tasks are resampled with replacement (fixed seed); the p-value is the share of
  resampled mean differences at least as far from the observed mean as the observed mean is from 0
  (the bootstrap distribution shifted to the null), with the +1 correction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    num_tasks: int
    mean_a: float  # mean over tasks of run A's per-task success rate
    mean_b: float
    mean_difference: float  # mean_a - mean_b
    wins: int  # tasks where A's rate is higher
    losses: int  # tasks where B's rate is higher
    ties: int
    mcnemar_p: float
    bootstrap_p: float
    bootstrap_ci: tuple[float, float]  # 95% percentile interval of the mean difference
    num_bootstrap: int
    seed: int


def mcnemar_exact_p(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of `wins` out of `wins + losses` at p = 1/2."""
    if wins < 0 or losses < 0:
        raise ValueError(f"counts must be >= 0, got {wins}, {losses}")
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap(
    differences: np.ndarray, num_bootstrap: int = 10_000, seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """Two-sided p-value and 95% interval of the mean of per-task `differences` `[tasks]`."""
    if differences.ndim != 1 or differences.size == 0:
        raise ValueError(f"need a non-empty 1-d array of per-task differences, got shape {differences.shape}")
    if num_bootstrap < 1:
        raise ValueError(f"num_bootstrap must be >= 1, got {num_bootstrap}")
    rng = np.random.default_rng(seed)
    n = differences.size
    means = differences[rng.integers(0, n, size=(num_bootstrap, n))].mean(axis=1)  # [num_bootstrap]
    observed = differences.mean()
    extreme = np.sum(np.abs(means - observed) >= abs(observed) - 1e-12)
    p = (1 + extreme) / (num_bootstrap + 1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(p), (float(low), float(high))


def compare_runs(
    rates_a: Mapping[Hashable, float],
    rates_b: Mapping[Hashable, float],
    num_bootstrap: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """Compares per-task success rates (`accounting.task_success_rates`) of two runs.

    Both runs must cover the same task ids; a `ValueError` names the ones that differ.
    """
    only_a, only_b = sorted(set(rates_a) - set(rates_b)), sorted(set(rates_b) - set(rates_a))
    if only_a or only_b:
        raise ValueError(
            f"paired comparison needs the same tasks in both runs; only in A: {only_a[:10]}, "
            f"only in B: {only_b[:10]} ({len(only_a)} and {len(only_b)} in all)"
        )
    if not rates_a:
        raise ValueError("paired comparison of two empty runs")
    keys = sorted(rates_a)
    a = np.array([rates_a[k] for k in keys], np.float64)  # [tasks]
    b = np.array([rates_b[k] for k in keys], np.float64)  # [tasks]
    wins, losses = int(np.sum(a > b)), int(np.sum(a < b))
    bootstrap_p, ci = paired_bootstrap(a - b, num_bootstrap, seed)
    return PairedComparison(
        num_tasks=len(keys),
        mean_a=float(a.mean()),
        mean_b=float(b.mean()),
        mean_difference=float((a - b).mean()),
        wins=wins,
        losses=losses,
        ties=len(keys) - wins - losses,
        mcnemar_p=mcnemar_exact_p(wins, losses),
        bootstrap_p=bootstrap_p,
        bootstrap_ci=ci,
        num_bootstrap=num_bootstrap,
        seed=seed,
    )
