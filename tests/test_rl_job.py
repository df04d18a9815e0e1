"""The RL job end to end: a run SIGKILLed mid-training and restarted with the same command
continues from its last checkpoint, takes exactly the steps an uninterrupted run takes, and
leaves each step once in metrics.jsonl, TensorBoard and trajectories.jsonl."""

import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

from agentgym_jax.rl.horizon import stepwise
from agentgym_jax.train.metrics import TIMING_KEYS, read_metrics
from agentgym_jax.job.play import task_batch
from environments.room.env import RoomEnv
from tests.rl_runs import TINY_RL_JOB, launch_command
from tests.test_metrics import _tensorboard_scalars

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4


# PPO with a separate critic: its parameters and optimizer state are a third part of the checkpoint.
SEPARATE_CRITIC = {"algo.advantage": "gae", "algo.critic": "separate", "algo.lam": 0.95}


def _command(workdir: pathlib.Path, algo: dict) -> list[str]:
    """A tiny job: every number is as small as the path through the code allows."""
    overrides = {
        **TINY_RL_JOB, "workdir": workdir, "seed": 3, **algo,
        "train.steps": STEPS, "train.checkpoint_every": 2, "train.keep_checkpoints": 10, "horizon_schedule.steps_per_stage": 2,
    }
    return launch_command("configs/quickstart.py", overrides)


# Each launch compiles for itself: with a persistent compilation cache, the restart's cached
# executables deadlocked in the CPU collectives of the 8 simulated devices when the machine was
# loaded (an XLA rendezvous timeout, then SIGABRT), measured with both tests running at once.
def _run(workdir: pathlib.Path, algo: dict) -> subprocess.CompletedProcess:
    return subprocess.run(_command(workdir, algo), cwd=REPO, capture_output=True, text=True, timeout=900)


def _per_step(records: list[dict]) -> dict[int, dict]:
    by_step = {r["step"]: {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records}
    assert len(by_step) == len(records), f"a step logged twice: {[r['step'] for r in records]}"
    return by_step


def _trajectories_by_step(workdir: pathlib.Path) -> dict[int, list[tuple]]:
    by_step: dict[int, list[tuple]] = {}
    lines = (workdir / "trajectories.jsonl").read_text().splitlines()
    for line in lines:
        t = json.loads(line)
        by_step.setdefault(t["policy_version"], {})[(t["group_id"], t["sample_idx"])] = (
            t["task_id"], t["status"], tuple(t["token_ids"])
        )
    assert sum(len(rows) for rows in by_step.values()) == len(lines), "an episode recorded twice"
    return {step: sorted(rows.items()) for step, rows in by_step.items()}


# PPO with a separate critic resumes the most state (policy, critic, both optimizers); the default
# estimator's resume is the same code with one part less (and the two-process test resumes
# REINFORCE++), so it is not run a second time here.
@pytest.mark.slow
@pytest.mark.parametrize("algo", [SEPARATE_CRITIC], ids=["gae-separate-critic"])
def test_sigkilled_run_resumes_exactly(tmp_path, algo):
    straight = _run(tmp_path / "straight", algo)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "summary: env=room" in straight.stdout.strip().splitlines()[-1]
    assert "mode=rl" in straight.stderr and "CheckpointManager" not in straight.stderr  # libraries' INFO lines filtered

    resumed_dir = tmp_path / "resumed"
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(resumed_dir, algo), cwd=REPO, stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)
    deadline = time.time() + 600
    metrics_path = resumed_dir / "metrics.jsonl"
    # Step 3 logged (and its episodes written), its checkpoint not due (every 2): the restart replays it.
    while not (metrics_path.exists() and any(r["step"] == 3 for r in read_metrics(str(metrics_path)))):
        assert proc.poll() is None and time.time() < deadline, f"the run ended before step 3: {log.read_text()[-3000:]}"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (resumed_dir / "checkpoints" / str(STEPS)).exists()

    resumed = _run(resumed_dir, algo)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((resumed_dir / "report.json").read_text())  # the run's time, and the last process's apart
    assert report["resumed_from_step"] == 2 and report["process_minutes"] < report["minutes"]
    assert f"minutes={report['minutes']:.1f}" in resumed.stdout.strip().splitlines()[-1]
    assert json.loads((tmp_path / "straight" / "report.json").read_text())["resumed_from_step"] is None

    first = read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))[0]  # the first step compiles its update
    assert first["compiled_programs"] >= 1 and 0 < first["compile_s"] < first["step_s"]
    a = _per_step(read_metrics(str(tmp_path / "straight" / "metrics.jsonl")))
    b = _per_step(read_metrics(str(resumed_dir / "metrics.jsonl")))
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert any(k.startswith("critic/") for k in a[STEPS]) == bool(algo)  # the critic trained, and is compared
    curve = _tensorboard_scalars(resumed_dir, "success_rate")
    assert curve == [(s, b[s]["success_rate"]) for s in range(1, STEPS + 1)]
    for step in range(3, STEPS + 1):  # the steps taken after the restart
        assert b[step] == a[step], f"step {step} differs after resume"
    schedule = stepwise((1, 2), 2)
    assert [a[s]["horizon"] for s in range(1, STEPS + 1)] == [schedule.horizon(s) for s in range(STEPS)]

    ta, tb = _trajectories_by_step(tmp_path / "straight"), _trajectories_by_step(resumed_dir)
    assert sorted(tb) == sorted(ta) == list(range(STEPS))
    for step in (2, 3):  # policy versions of the steps after the restart
        assert ta[step] == tb[step]
        tasks = [row[1][0] for row in ta[step][::2]]  # sample 0 of each group
        assert tasks == task_batch(RoomEnv.task_info().splits["train"], step, 2, seed=3)
