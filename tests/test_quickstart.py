"""The CPU quickstart, shortened, run to the end: GRPO raises held-out success over its SFT start.

Same recipe as `configs/quickstart.py` (SFT on 200 oracle demonstrations, GRPO with the stepwise
horizon), fewer RL steps and held-out tasks. Measured on seed 0, one CPU device: 32 held-out
tasks, 0.344 -> 0.594 after 10 steps with SFT batches grouped by length (0.3125 -> 0.500 before
them); the full quickstart: 64 tasks, 0.359 -> 0.719 after 24 steps.
"""

import json

import pytest

from agentgym_jax.eval.compare import compare_dirs
from agentgym_jax.train.metrics import read_metrics
from environments.room.env import RoomEnv
from tests.rl_runs import OPTIMISED, run_rl_job

STEPS = 10


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~6 min on an idle 2-core machine; 15 under load, past pytest.ini's 900 s
def test_shortened_quickstart_improves_held_out_success(tmp_path):
    overrides = {
        "workdir": tmp_path, "train.steps": STEPS, "train.checkpoint_every": STEPS,
        "horizon_schedule.steps_per_stage": 4, "eval.num_tasks": 32, "eval.sampled": 2,
    }
    # XLA's optimisations on, as a user runs it: the lift below was measured with them (conftest.py).
    summary = run_rl_job("configs/quickstart.py", overrides, extra_env=OPTIMISED)
    tasks, before, after = summary.tasks, summary.before, summary.after
    assert summary.env == "room"
    assert tasks == 32
    assert 0.1 < before < 0.8  # a real but imperfect start
    assert after > before, f"held-out success {before:.3f} -> {after:.3f}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["success_before"] == pytest.approx(before, abs=1e-3)
    test_ids = sorted(RoomEnv.task_info().splits["test"])[:32]
    for phase, rate in (("before", before), ("after", after)):  # per-task outcomes, and their Wilson interval
        outcomes = report[phase]["task_success"]
        assert [t for t, _ in outcomes] == test_ids and sum(s for _, s in outcomes) / 32 == pytest.approx(rate, abs=1e-3)
        low, high = report["wilson_95"][phase]
        assert low < rate < high and high - low > 0.2  # 32 tasks: about +-0.17 around the middle
    # The sampled evaluation: each task twice at the rollout's temperature, its own file and report entry.
    sampled = report["sampled"]
    assert (sampled["temperature"], sampled["samples"]) == (1.0, 2)
    for phase in ("before", "after"):
        records = [json.loads(line) for line in (tmp_path / f"sampled_{phase}.jsonl").read_text().splitlines()]
        assert sorted((r["task_id"], r["sample_idx"]) for r in records) == [(t, s) for t in test_ids for s in (0, 1)]
        assert sampled[f"success_{phase}"] == pytest.approx(sum(r["status"] == "success" for r in records) / 64)
    paired = compare_dirs(tmp_path, f"{tmp_path}:before")  # RL against its own SFT start, task by task
    assert paired.mean_difference == pytest.approx(after - before, abs=1e-3) and paired.wins > 0
    assert [r["horizon"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [4] * 4 + [8] * 4 + [12] * 2
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
