"""A CPU recipe beyond the room, shortened, run to the end on TextArena's Guess The Number
(`configs/guess_the_number_cpu.py`): its SFT start is real, its held-out seeds are never played,
its demonstrations cover every training seed, and the horizon schedule moves through 5, 8, 10 turns.

Whether GRPO raises held-out success here is not asserted: over eight full runs the gain was
+0.05 (p = 0.18, docs/experiments.md), and the shortened run's sign depends on the float rounding
of one seed (measured on 2026-12-06, AMD EPYC, 12 steps: 0.650 -> 0.600 on seed 0 and 0.350 ->
0.350 on seed 1 with prefix-tree packing, then the CPU recipes' default, 0.350 -> 0.650 on seed 0
without it, their default again). The quickstart's
test asserts a lift; a lift that holds on every seed is issue 44's.
"""

import json

import pytest

from agentgym_jax.train.metrics import read_metrics
from environments.textarena import games
from environments.textarena.env import TEST_EVERY
from tests.markers import long_test
from tests.rl_runs import run_rl_job

STEPS = 3


@pytest.mark.slow
@long_test
@pytest.mark.timeout(1500)  # 14.4 min in the suite (-n 2) on a slow instance of the 2-core machine
def test_shortened_guess_the_number_recipe_runs_its_schedule_on_held_out_seeds(tmp_path):
    overrides = {"workdir": tmp_path, "train.steps": STEPS, "train.checkpoint_every": STEPS, "horizon_schedule.steps_per_stage": 1}
    summary = run_rl_job("configs/guess_the_number_cpu.py", overrides)
    tasks, before, after = summary.tasks, summary.before, summary.after
    assert summary.env == "textarena"
    assert 0.1 < before < 0.8  # a real but imperfect start

    # Only Guess The Number (`env.tasks`): its 20 test seeds held out, its training seeds played.
    test_ids = list(range(0, games.TASKS_PER_GAME, TEST_EVERY))
    report = json.loads((tmp_path / "report.json").read_text())
    assert tasks == 20 and [t for t, _ in report["after"]["task_success"]] == test_ids
    assert sum(s for _, s in report["after"]["task_success"]) / 20 == pytest.approx(after, abs=1e-3)  # the per-task record
    played = {json.loads(line)["task_id"] for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()}
    assert played and all(t < games.TASKS_PER_GAME and t % TEST_EVERY for t in played)
    demos = [json.loads(line) for line in (tmp_path / "demonstrations.jsonl").read_text().splitlines()]
    assert {d["task_id"] for d in demos} == {i for i in range(games.TASKS_PER_GAME) if i % TEST_EVERY}
    assert [r["horizon"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [5, 8, 10]
