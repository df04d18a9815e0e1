"""Paired comparison: exact McNemar and paired bootstrap against hand-computed cases."""

import itertools
import json

import numpy as np
import pytest

from agentgym_jax.eval import compare, paired


def test_mcnemar_exact_hand_computed():
    # 8 wins, 2 losses: 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 * 56 / 1024.
    assert paired.mcnemar_exact_p(8, 2) == pytest.approx(112 / 1024, abs=1e-15)
    assert paired.mcnemar_exact_p(2, 8) == pytest.approx(112 / 1024, abs=1e-15)
    assert paired.mcnemar_exact_p(0, 5) == pytest.approx(2 / 32, abs=1e-15)
    assert paired.mcnemar_exact_p(3, 3) == 1.0  # 2 * 42/64 > 1 is capped
    assert paired.mcnemar_exact_p(0, 0) == 1.0
    assert paired.mcnemar_exact_p(1, 0) == 1.0  # 2 * 1/2
    with pytest.raises(ValueError, match=">= 0"):
        paired.mcnemar_exact_p(-1, 2)


def test_bootstrap_degenerate_cases():
    p, ci = paired.paired_bootstrap(np.full(7, 0.25), num_bootstrap=999, seed=3)
    assert p == pytest.approx(1 / 1000) and ci == pytest.approx((0.25, 0.25))
    p, _ = paired.paired_bootstrap(np.zeros(5), num_bootstrap=999)
    assert p == 1.0
    with pytest.raises(ValueError, match="non-empty 1-d"):
        paired.paired_bootstrap(np.zeros(0))


def test_bootstrap_p_matches_exact_enumeration_of_resamples():
    differences = np.array([1.0, 0.5, -0.25])
    observed = differences.mean()
    resamples = list(itertools.product(range(3), repeat=3))  # all 27 equally likely resamples
    exact = sum(abs(differences[list(r)].mean() - observed) >= abs(observed) - 1e-12 for r in resamples) / 27
    p, (low, high) = paired.paired_bootstrap(differences, num_bootstrap=20_000, seed=0)
    assert p == pytest.approx(exact, abs=0.015)
    assert low == pytest.approx(-0.25, abs=0.09) and high == pytest.approx(1.0)
    assert paired.paired_bootstrap(differences, 500, seed=1) == paired.paired_bootstrap(differences, 500, seed=1)


def test_compare_runs_counts_and_errors():
    a = {("maze", 0): 1.0, ("maze", 1): 0.5, ("maze", 2): 0.0, ("maze", 3): 1.0}
    b = {("maze", 0): 0.0, ("maze", 1): 0.5, ("maze", 2): 0.5, ("maze", 3): 0.0}
    c = paired.compare_runs(a, b, num_bootstrap=200)
    assert (c.wins, c.losses, c.ties) == (2, 1, 1)
    assert c.mcnemar_p == 1.0  # 2 * (C(3,0) + C(3,1)) / 2^3 = 1
    assert c.mean_difference == pytest.approx((1 + 0 - 0.5 + 1) / 4)
    assert (c.mean_a, c.mean_b) == (pytest.approx(2.5 / 4), pytest.approx(1.0 / 4))
    with pytest.raises(ValueError, match=r"only in A: \[\('maze', 3\)\]"):
        paired.compare_runs(a, {k: v for k, v in b.items() if k != ("maze", 3)})


def _rl_run(folder, before, after):
    """An RL workdir's report.json as `rl_loop` writes it (only the fields compare reads)."""
    folder.mkdir()
    report = {phase: {"task_success": [[t, s] for t, s in enumerate(xs)]} for phase, xs in (("before", before), ("after", after))}
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_seeds_pair_with_their_partner_only_and_bad_folders_are_named(tmp_path):
    # Seed 0: A wins tasks 0, 1; seed 1: A loses task 0. Pooled: 2 wins, 1 loss over 6 (seed, task) keys.
    # Pairing across seeds (A0 with B1) would give 1 win, 0 losses instead.
    a = [_rl_run(tmp_path / "a0", [0, 0, 0], [1, 1, 0]), _rl_run(tmp_path / "a1", [0, 0, 0], [0, 1, 1])]
    b = [_rl_run(tmp_path / "b0", [1, 0, 0], [0, 0, 0]), _rl_run(tmp_path / "b1", [0, 0, 0], [1, 1, 1])]
    c = compare.compare_dirs(a, b, num_bootstrap=100)
    assert (c.num_tasks, c.wins, c.losses, c.ties) == (6, 2, 1, 3)
    assert c.mean_difference == pytest.approx((2 - 1) / 6)
    before = compare.compare_dirs([f"{a[0]}:before"], [f"{b[0]}:before"], num_bootstrap=100)
    assert (before.wins, before.losses) == (0, 1)
    with pytest.raises(ValueError, match="2 runs A against 1 runs B"):
        compare.compare_dirs(a, b[:1])
    with pytest.raises(ValueError, match="holds no report.json"):
        compare.compare_dirs(tmp_path / "a0", tmp_path)
    with pytest.raises(ValueError, match="not 'middle'"):
        compare.compare_dirs(f"{a[0]}:middle", b[0])


def test_a_sampled_evaluation_compares_each_tasks_share_of_successful_samples(tmp_path):
    # Two samples a task: A after RL wins 2/2, 1/2, 0/2 on tasks 0-2; its SFT start 0/2, 1/2, 1/2.
    # Rates 1, 0.5, 0 against 0, 0.5, 0.5: one win, one tie, one loss; mean difference (1 - 0.5) / 3.
    pairs = lambda wins: [[t, int(s < w)] for t, w in enumerate(wins) for s in range(2)]  # noqa: E731
    run = _rl_run(tmp_path / "a", [0, 0, 0], [1, 1, 1])
    report = json.loads((run / "report.json").read_text())
    report["sampled"] = {"before": {"task_success": pairs([0, 1, 1])}, "after": {"task_success": pairs([2, 1, 0])}}
    (run / "report.json").write_text(json.dumps(report))
    assert compare.task_rates(f"{run}:sampled_after") == {0: 1.0, 1: 0.5, 2: 0.0}
    c = compare.compare_dirs(f"{run}:sampled_after", f"{run}:sampled_before", num_bootstrap=100)
    assert (c.wins, c.losses, c.ties) == (1, 1, 1) and c.mean_difference == pytest.approx(0.5 / 3)
    plain = _rl_run(tmp_path / "b", [0, 0, 0], [1, 1, 1])
    with pytest.raises(ValueError, match=r"no sampled evaluation \(eval.sampled=0\)"):
        compare.task_rates(f"{plain}:sampled_after")
