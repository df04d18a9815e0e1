"""A CPU recipe beyond the room, shortened, run to the end: GRPO raises held-out success over its
SFT start on TextArena's Guess The Number (`configs/guess_the_number_cpu.py`).

This runs the recipe with half its GRPO steps, 4 at each horizon. Measured on one CPU device:
20 held-out seeds, 0.400 -> 0.550 on seed 0 (the one asserted) and 0.350 -> 0.400 on seed 1.
The full 24-step recipe rose on 2 of 5 seeds, stayed level on 2 and fell on one
(docs/experiments.md), so this asserts seed 0's deterministic run, not a property of every seed.
"""

import json

import pytest

from agentgym_jax.train.metrics import read_metrics
from environments.textarena import games
from environments.textarena.env import TEST_EVERY
from tests.rl_runs import run_rl_job

STEPS = 12


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~4 min on an idle 2-core machine
def test_shortened_guess_the_number_recipe_improves_held_out_success(tmp_path):
    overrides = {"workdir": tmp_path, "train.steps": STEPS, "train.checkpoint_every": STEPS, "horizon_schedule.steps_per_stage": 4}
    summary = run_rl_job("configs/guess_the_number_cpu.py", overrides)
    tasks, before, after = summary.tasks, summary.before, summary.after
    assert summary.env == "textarena"
    assert 0.1 < before < 0.8  # a real but imperfect start
    assert after > before, f"held-out success {before:.3f} -> {after:.3f}"

    # Only Guess The Number (`env.tasks`): its 20 test seeds held out, its training seeds played.
    test_ids = list(range(0, games.TASKS_PER_GAME, TEST_EVERY))
    report = json.loads((tmp_path / "report.json").read_text())
    assert tasks == 20 and [t for t, _ in report["after"]["task_success"]] == test_ids
    played = {json.loads(line)["task_id"] for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()}
    assert played and all(t < games.TASKS_PER_GAME and t % TEST_EVERY for t in played)
    demos = [json.loads(line) for line in (tmp_path / "demonstrations.jsonl").read_text().splitlines()]
    assert {d["task_id"] for d in demos} == {i for i in range(games.TASKS_PER_GAME) if i % TEST_EVERY}
    assert [r["horizon"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [5] * 4 + [8] * 4 + [10] * 4
