"""`mode=collect`: an oracle collection SIGKILLed part-way and restarted with the same command
holds every (task, sample) exactly once, in our JSONL and in AgentGym's conversation format."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.eval import collect
from agentgym_jax.eval.collect import AGENTGYM_NAME
from agentgym_jax.eval.runner import TRAJECTORIES_NAME
from agentgym_jax.rollout.collect import resume_jsonl
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl
from agentgym_jax.rollout import agentgym_format
from configs import collect as collect_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TASKS = (10, 50)  # maze training ids 10..49
SAMPLES = 2


def collect_command(out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/collect.py", "--config.envs=maze",
            f"--config.task_ids={TASKS[0]}:{TASKS[1]}", f"--config.group_size={SAMPLES}",
            "--config.batch_episodes=2", f"--config.out_dir={out}"]


@pytest.mark.slow
def test_killed_collection_resumes_without_duplicates(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = subprocess.Popen(collect_command(out), cwd=REPO, env=env, **quiet)
    path = out / TRAJECTORIES_NAME
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if path.exists() and path.read_bytes().count(b"\n") >= 10:
                break
            time.sleep(0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL, "the collection ended before it could be killed"
    before = len(resume_jsonl(path))
    assert 10 <= before < (TASKS[1] - TASKS[0]) * SAMPLES

    done = subprocess.run(collect_command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = list(read_jsonl(str(path)))
    keys = [(t.task_id, t.sample_idx, t.attempt) for t in records]
    assert sorted(keys) == [(task, s, 0) for task in range(*TASKS) for s in range(SAMPLES)]  # each exactly once
    assert all(t.status is EpisodeStatus.SUCCESS and t.env == "maze" for t in records)  # the oracle, horizon 100

    items = agentgym_format.read_file(out / AGENTGYM_NAME)
    expected_ids = [f"maze_{task}" for task in range(*TASKS) for _ in range(SAMPLES)]
    assert sorted(item["item_id"] for item in items) == sorted(expected_ids)
    for item in items:
        turns = item["conversations"]
        assert item["success"] == 1 and turns[0]["from"] == "human" and turns[0]["loss"] is None
        assert [t["from"] for t in turns[1:]] == ["gpt", "human"] * ((len(turns) - 2) // 2) + ["gpt"]
        assert all(t["loss"] is True and t["value"].startswith("Action: ") for t in turns[1::2])
    assert f"records={len(records)} dataset_items={len(records)}" in done.stdout


def test_resume_cuts_a_torn_last_line(tmp_path):
    record = Trajectory(task_id=3, env="maze", group_id=3, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                        turn_spans=[(1, 2)], turn_rewards=[1.0], reward=1.0, status=EpisodeStatus.SUCCESS)
    path = tmp_path / "t.jsonl"
    line = json.dumps(record.to_json())
    path.write_text(line + "\n" + line[: len(line) // 2])  # the writer died mid-line
    assert [t.task_id for t in resume_jsonl(path)] == [3]
    assert path.read_text() == line + "\n"  # appending now starts on a clean line
    assert resume_jsonl(tmp_path / "absent.jsonl") == []


def test_mode_collect_refuses_an_out_dir_of_another_run(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"envs": "maze", "policy": "hf:/elsewhere"}))
    config = collect_config.get_config()
    config.out_dir = str(tmp_path)
    with pytest.raises(ValueError, match="holds a run with other settings .*'policy': \\('hf:/elsewhere', 'oracle'\\)"):
        collect.run(config)  # refused before any server starts
    assert not (tmp_path / TRAJECTORIES_NAME).exists()


pytestmark = pytest.mark.timeout(400)
