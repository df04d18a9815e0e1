"""mode=agentevol: success filtering and dedup, resume after a SIGKILL mid-iteration, and (slow)
the second iteration beating behaviour cloning on held-out Room tasks."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.job import setup
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train.agentevol import keep_successes, merge_dedup
from agentgym_jax.train.sft import BehaviourCloning
from agentgym_jax.train import settings
from configs import agentevol as agentevol_config
from tests.markers import long_test
from tests.rl_runs import with_compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]


def _t(task_id, tokens, reward=1.0, status=EpisodeStatus.SUCCESS):
    n = len(tokens)
    return Trajectory(task_id=task_id, env="room", group_id=0, token_ids=list(tokens), loss_mask=[1] * n,
                      logprobs=[0.0] * n, turn_spans=[(0, n)], turn_rewards=[reward], reward=reward, status=status)


def test_keep_successes_keeps_the_verifier_s_successes_whatever_the_reward():
    kept = keep_successes([_t(1, [1], 1.0), _t(2, [2], 0.5, EpisodeStatus.FAILURE), _t(3, [3], 0.2),
                           _t(4, [4], 1.0, EpisodeStatus.INFRA_ERROR), _t(5, [5], 0.97, EpisodeStatus.MAX_TURNS)])
    assert [t.task_id for t in kept] == [1, 3]  # 5: shaped credit near 1 is still a failure


def test_merge_dedups_by_task_and_token_sequence_keeping_base_first():
    base = [_t(1, [5, 6]), _t(2, [5, 6])]
    explored = [_t(1, [5, 6]), _t(1, [5, 7]), _t(1, [5, 7]), _t(2, [5, 6]), _t(3, [5, 6])]
    merged = merge_dedup(base, explored)
    assert [(t.task_id, tuple(t.token_ids)) for t in merged] == [(1, (5, 6)), (2, (5, 6)), (1, (5, 7)), (3, (5, 6))]
    assert merged[0] is base[0]


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_each_iteration_schedule_spans_its_own_updates(schedule):
    """A cosine decay ends at the last update of that iteration's training (4 or 8 updates here),
    whatever the other iterations' lengths; constant-rate iterations share one compiled update."""
    config = agentevol_config.get_config()
    config.optim.lr_schedule, config.sft.batch_size = schedule, 16
    config.model.hidden_size, config.model.intermediate_size, config.model.head_dim = 32, 64, 8
    model = setup.model_config(config, vocab_size=64)
    mesh = make_mesh(1, -1, 1)
    params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(0), value_head=False)
    phases = BehaviourCloning(config, settings.update(config, model), mesh)
    (short, short_fns), (long, long_fns) = (phases.fresh_state(params, rows=rows, epochs=2) for rows in (32, 64))
    assert (short_fns is long_fns) == (schedule == "constant")
    host = jax.device_get(params)  # one device: eager collectives over 8 simulated ones can stall
    grads = jax.tree.map(jnp.ones_like, host)

    def moved(state, n):  # does the n-th update (1-based) change the parameters?
        opt_state = jax.device_get(state.opt_state)
        for _ in range(n):
            updates, opt_state = state.tx.update(grads, opt_state, host)
        return any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))

    assert moved(short, 4) and moved(long, 8)
    assert moved(short, 5) == moved(long, 9) == (schedule == "constant")  # cosine: the rate is 0 after the last


def _command(workdir, seed, **overrides):
    args = {"workdir": workdir, "seed": seed, "rollout.lock_step": True, "rollout.max_cache_len": 1024,
            "rollout.max_tokens_per_turn": 8, "model.hidden_size": 64, "model.intermediate_size": 128,
            "model.head_dim": 16, **overrides}
    return [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/agentevol.py"] + [
        f"--config.{k}={v}" for k, v in args.items()
    ]


# One CPU device, not the suite's eight: the sampler and update compile about twice as fast
# (sharded updates have their own tests).
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

# As small as the path through the code allows: one exploration round of 2 episodes of one turn
# (a 256-token cache holds the ~100-token prompt, prefilled as a 128-token chunk, and the turn).
TINY = {"agentevol.iterations": 1, "agentevol.explore_tasks": 1, "agentevol.group_size": 2,
        "agentevol.horizon": 1, "sft.num_tasks": 2, "sft.epochs": 1, "eval.num_tasks": 1, "eval.horizon": 1,
        "rollout.max_cache_len": 256, "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 8}


def _episodes(path):
    """The explored episodes of a JSONL file without their wall-clock timings."""
    return [{k: v for k, v in json.loads(line).items() if k != "timings"} for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkilled_run_resumes_at_its_iteration(tmp_path):
    workdir = tmp_path / "run"
    env = with_compile_cache(ONE_DEVICE, tmp_path / "jax_cache")  # the restart loads what the first launch compiled
    proc = subprocess.Popen(_command(workdir, 0, **TINY), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (workdir / "iter_1" / "data.jsonl").exists():  # iteration 1 explored, not yet trained
        assert proc.poll() is None and time.time() < deadline, "the run ended before iteration 1 explored"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (workdir / "checkpoints" / "1").exists()
    explored_before = workdir / "iter_1" / "explored.before.jsonl"
    shutil.copy(workdir / "iter_1" / "explored.jsonl", explored_before)
    data_before = (workdir / "iter_1" / "data.jsonl").read_text()
    eval_0 = (workdir / "iter_0" / "eval.json").stat().st_mtime_ns

    resumed = subprocess.run(_command(workdir, 0, **TINY), cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("agentevol:")]
    assert [line.split()[1] for line in lines] == ["iteration=1"]  # iteration 0 not redone
    assert (workdir / "iter_0" / "eval.json").stat().st_mtime_ns == eval_0
    # Exploration is a function of (restored iteration-0 params, seed, iteration): the same sampled
    # episodes (temperature 1, token for token) and the same training set again.
    explored = _episodes(workdir / "iter_1" / "explored.jsonl")
    assert len(explored) == 2 and all(e["status"] == "max_turns" and e["turn_spans"] for e in explored)
    assert explored == _episodes(explored_before)
    assert (workdir / "iter_1" / "data.jsonl").read_text() == data_before
    progress = json.loads((workdir / "progress.json").read_text())
    assert progress["completed"] == 1 and sorted(progress["iterations"]) == ["0", "1"]
    assert progress["iterations"]["1"]["explored_episodes"] == 2
    assert all((workdir / "checkpoints" / str(i)).is_dir() for i in range(2))


LEARN = {"agentevol.iterations": 2, "agentevol.explore_tasks": 32, "agentevol.group_size": 4,
         "sft.num_tasks": 8, "sft.epochs": 30, "sft.batch_size": 8, "eval.num_tasks": 32}


# Not reliable within the CI budget (numbers in the docstring): stays behind AGENTGYM_LONG_TESTS.
@long_test
@pytest.mark.slow
def test_second_iteration_beats_behaviour_cloning(tmp_path):
    """8 oracle demonstrations give a weak BC policy; exploring 32 training tasks x 4 samples at
    temperature 1 and retraining on the successes raises held-out (greedy) success.

    Measured with this config (held-out success of iterations 0 / 1 / 2 on 32 Room test tasks,
    one CPU device): seed 0: 0.188 / 0.188 / 0.344; seed 1: 0.094 / 0.219 / 0.344; seed 2:
    0.062 / 0.094 / 0.094 (margins +0.156, +0.250, +0.031: seed 2 would fail the 5-point margin).
    224 to 568 s per run depending on the machine's load, 600 s on the suite's 8 devices. Shrunk
    variants (seed 0) did not learn: horizon 8 and a 512-token cache gave 0.125 / 0.188 / 0.125
    in 222 s; 20 SFT epochs at lr 5e-3 and exploration at temperature 0.7 gave 0 / 0 / 0 in 179 s.
    Thirteen more runs of other variants, and why none is both reliable and short enough: docs/trainers.md.
    """
    run = subprocess.run(_command(tmp_path, 0, **LEARN), cwd=REPO, env=ONE_DEVICE, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    iterations = json.loads((tmp_path / "progress.json").read_text())["iterations"]
    bc, second = iterations["0"]["eval"]["success_rate"], iterations["2"]["eval"]["success_rate"]
    assert iterations["2"]["kept"] > 0 and iterations["2"]["train_trajectories"] > iterations["0"]["train_trajectories"]
    assert second >= bc + 0.05, (bc, second)
