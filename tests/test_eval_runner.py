"""The evaluation runner against real Maze servers: a server SIGKILLed mid-evaluation, retries as
attempts, policies loaded from an RL checkpoint and a Hugging Face folder, and `mode=eval`
through the launcher.

The kill test: 50 tasks x 2 samples over two servers, played in batches of 20 episodes. Once the
20 episodes of the first batch have all been reset (half of them on each server), server B is
SIGKILLed; those 10 episodes end `infra_error`, later batches open their sessions on A. The
oracle plays with a horizon of 10 turns, so a task succeeds exactly when its shortest path
(worked out in-process, not by the server) is at most 10 moves: the first 10 tasks are short,
then 25 short and 15 long ones. Expected: 100 scheduled, 60 successes, 30 max_turns failures,
10 infra errors -> 60.0% end-to-end, 66.7% conditional, 10% infra.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from agentgym_jax.envs.client import EnvServerError
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.eval import compare, runner, schedule
from agentgym_jax.eval.accounting import MISSING
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models import decoder, hf_checkpoint
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.collect import ModelPolicy, OraclePolicy
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.job import setup
from agentgym_jax.job.checkpoint import Checkpointer
from agentgym_jax.train.state import TrainState, make_optimizer
from environments.maze import env as maze

from configs import eval as eval_config

REPO = pathlib.Path(__file__).resolve().parents[1]
HORIZON = 10


def shortest_path(task_id: int) -> int:
    """Moves the maze oracle needs for a task, played in-process (independent of the servers)."""
    env = maze.MazeEnv()
    env.reset(task_id)
    moves = 0
    while not env.verify():
        env.step(env.oracle_action())
        moves += 1
    return moves


def kill_schedule() -> tuple[list[int], set[int]]:
    """10 short tasks, then 25 short and 15 long ones interleaved; and the set of short ones."""
    short, long_ = [], []
    for task in range(maze.MazeEnv.task_info().num_tasks):
        (short if shortest_path(task) <= HORIZON else long_).append(task)
        if len(short) >= 35 and len(long_) >= 15:
            break
    rest = short[10:35] + long_[:15]
    rest = [rest[i] for i in np.random.default_rng(0).permutation(len(rest))]
    return short[:10] + rest, set(short)


class KillingPool(EnvPool):
    """A real pool that SIGKILLs `victim` once `kill_after` resets have answered, holding every
    episode at its reset until then (so no episode of the first batch has finished)."""

    def __init__(self, urls, victim: LocalServers, kill_after: int, **kwargs):
        super().__init__(urls, **kwargs)
        self.victim, self.kill_after, self.resets = victim, kill_after, 0
        self.killed = asyncio.Event()

    async def reset(self, slot, data_idx, **kwargs):
        result = await super().reset(slot, data_idx, **kwargs)
        self.resets += 1
        if self.resets == self.kill_after:
            process = self.victim.servers[0].process
            process.kill()  # SIGKILL
            process.wait()
            self.killed.set()
        await self.killed.wait()
        return result


@pytest.fixture(scope="module")
def framing(tmp_path_factory) -> ChatFraming:
    folder = bt.build_tokenizer(tmp_path_factory.mktemp("tok"), [maze.INSTRUCTION], vocab_size=1024)
    return ChatFraming(load_tokenizer(folder))


def test_killed_server_is_counted_in_the_end_to_end_denominator(framing, tmp_path):
    tasks, short = kill_schedule()
    info = maze.MazeEnv.task_info()
    with LocalServers(["maze"]) as a, LocalServers(["maze"]) as b:
        urls = [a.servers[0].url, b.servers[0].url]
        pool = KillingPool(urls, b, kill_after=20, max_retries=1, backoff_s=0.01)
        kwargs = dict(group_size=2, horizon=HORIZON, seed=0, batch_episodes=20)
        summary = runner.report(OraclePolicy(framing), {"maze": pool}, {"maze": info}, {"maze": tasks}, tmp_path,
                                  max_attempts=1, **kwargs)
        assert b.servers[0].process.returncode == -9 and a.servers[0].process.poll() is None

        m = summary.overall
        assert (m.scheduled, m.success.numerator, m.infra_rate.numerator) == (100, 60, 10)
        assert m.success.value == pytest.approx(0.60)
        assert (m.conditional_success.numerator, m.conditional_success.denominator) == (60, 90)
        assert m.conditional_success.value == pytest.approx(2 / 3)
        assert m.infra_rate.value == pytest.approx(0.10)
        assert m.status_counts == {**{s.value: 0 for s in EpisodeStatus}, MISSING: 0,
                                   "success": 60, "max_turns": 30, "infra_error": 10}
        assert m.retries == 0 and m.status_mismatches == 0
        # the lost episodes: one sample of each task of the first batch, nothing later
        infra = [e for e in summary.episodes if e.status == "infra_error"]
        assert sorted(e.task_id for e in infra) == sorted(tasks[:10])
        for e in summary.episodes:
            if e.is_scored:
                assert e.success == (e.task_id in short)
        # the report on disk says the same
        on_disk = json.loads((tmp_path / "summary.json").read_text())["overall"]
        assert on_disk["success"]["value"] == pytest.approx(0.6) and on_disk["infra_rate"]["numerator"] == 10
        assert "60.0% [50.2, 69.1] (60/100)" in (tmp_path / "summary.md").read_text()
        assert (tmp_path / "success_by_env.png").read_bytes()[:4] == b"\x89PNG"

        before = tmp_path / "before"
        shutil.copytree(tmp_path, before, ignore=shutil.ignore_patterns("before"))

        # resumed with retries allowed: the 10 lost episodes are played again as attempt 1 (on A)
        pool = EnvPool(urls, max_retries=1, backoff_s=0.01)
        summary = runner.report(OraclePolicy(framing), {"maze": pool}, {"maze": info}, {"maze": tasks}, tmp_path,
                                  max_attempts=2, **kwargs)
    m = summary.overall
    assert (m.success.numerator, m.infra_rate.numerator, m.retries) == (70, 0, 10)
    assert m.status_counts["max_turns"] == 30
    records = list(read_jsonl(str(tmp_path / runner.TRAJECTORIES_NAME)))
    assert len(records) == 110
    retried = sorted((t.task_id, t.sample_idx) for t in records if t.attempt == 1)
    lost = sorted((t.task_id, t.sample_idx) for t in records if t.status is EpisodeStatus.INFRA_ERROR)
    assert retried == lost and len(lost) == 10
    assert all(t.status is EpisodeStatus.SUCCESS for t in records if t.attempt == 1)

    # recounted from the files, and the two runs compared task by task
    recount = runner.load_summary(before).overall
    assert (recount.success.numerator, recount.infra_rate.numerator) == (60, 10)
    comparison = compare.compare_dirs(tmp_path, before)
    assert (comparison.wins, comparison.losses, comparison.ties) == (10, 0, 40)  # the 10 recovered tasks
    assert comparison.mcnemar_p == pytest.approx(2 * 0.5**10)
    assert comparison.mean_difference == pytest.approx(10 * 0.5 / 50)


# ---- policies from an RL checkpoint and a Hugging Face folder ---------------------------------


def random_params(config: ModelConfig, seed: int):
    """Host-drawn weights in the shapes `init_params` gives (skips compiling the Flax init)."""
    shapes = jax.eval_shape(lambda key: decoder.init_params(config, key), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: jax.numpy.asarray(0.05 * rng.standard_normal(leaf.shape), leaf.dtype), shapes)


def small_model(vocab_size: int) -> ModelConfig:
    return ModelConfig.small(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_heads=2,
                             num_kv_heads=1, head_dim=16, num_layers=1)


def tiny_config(**overrides):
    config = eval_config.get_config()
    config.rollout.max_tokens_per_turn = 4
    config.rollout.max_cache_len = 512
    for key, value in overrides.items():
        config[key] = value
    return config


def test_checkpoint_policy_is_the_trained_params_not_the_reference(framing, tmp_path):
    """An RL workdir (orbax `(TrainState, ref_params)`, config.json, tokenizer/) -> its policy."""
    framing.tokenizer.save_pretrained(tmp_path / "tokenizer")
    model = small_model(len(framing.tokenizer))
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf_dict()))
    trained, ref = random_params(model, 1), random_params(model, 2)
    optim = dict(  # any optimizer: its state is not part of the policy
lr=1e-3, warmup_steps=0, total_updates=10, lr_schedule="constant", weight_decay=0.0,
                 grad_clip=1.0, b1=0.9, b2=0.99)
    state = TrainState.create(trained, make_optimizer(ml_collections.ConfigDict(optim)), jax.random.key(0))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=1)
    ckpt.save(3, (state, ref), {"rl_step": 3})
    ckpt.close()

    config = tiny_config(policy=f"checkpoint:{tmp_path}")
    policy, loaded_framing = setup.make_policy(config, {}, tmp_path / "out")
    assert isinstance(policy, ModelPolicy)
    assert loaded_framing.tokenizer.get_vocab() == framing.tokenizer.get_vocab()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(policy.params), trained)

    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 7 .*steps: \[3\]"):
        setup.make_policy(tiny_config(policy=f"checkpoint:{tmp_path}", checkpoint_step=7), {}, tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        setup.make_policy(tiny_config(policy=f"hf:{tmp_path / 'tokenizer'}"), {}, tmp_path)
    with pytest.raises(ValueError, match="policy must be"):
        setup.make_policy(tiny_config(policy="random"), {}, tmp_path)


def test_bad_schedules_are_refused(tmp_path):
    info = maze.MazeEnv.task_info()
    first_test = info.splits["test"][0]
    assert schedule.task_ids(tiny_config(task_ids="3"), info) == info.splits["test"][:3]
    assert schedule.task_ids(tiny_config(task_ids=f"{first_test}:{first_test + 2}"), info) == [first_test, first_test + 1]
    assert schedule.task_ids(tiny_config(split="", task_ids="0:2"), info) == [0, 1]
    with pytest.raises(ValueError, match="not in maze's split 'test'"):
        schedule.task_ids(tiny_config(task_ids="0:2"), info)
    with pytest.raises(ValueError, match="has no split 'dev'"):
        schedule.task_ids(tiny_config(split="dev"), info)
    with pytest.raises(ValueError, match="task_ids must be"):
        schedule.task_ids(tiny_config(task_ids="ten"), info)
    with pytest.raises(ValueError, match="not in envs"):
        setup.parse_urls("room=http://x", ["maze"])
    assert setup.parse_urls("maze=http://a, maze=http://b", ["maze"]) == {"maze": ["http://a", "http://b"]}
    schedule.check_run_spec(tiny_config(), tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        schedule.check_run_spec(tiny_config(horizon=3), tmp_path)


@pytest.mark.slow
def test_mode_eval_through_the_launcher_with_a_hf_policy(framing, tmp_path):
    """A random Hugging Face folder, sampled at temperature 1 with 2 samples per task."""
    hf = tmp_path / "hf"
    framing.tokenizer.save_pretrained(tmp_path / "tok")
    model = small_model(len(framing.tokenizer))
    hf_checkpoint.save_pretrained(random_params(model, 0), model, hf, tokenizer_dir=tmp_path / "tok")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/eval.py", f"--config.policy=hf:{hf}",
           "--config.task_ids=2", "--config.group_size=2", "--config.temperature=1.0", "--config.horizon=2",
           "--config.rollout.max_tokens_per_turn=4", "--config.rollout.max_cache_len=512", f"--config.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "summary: envs=maze scheduled=4 " in done.stdout
    records = list(read_jsonl(str(out / runner.TRAJECTORIES_NAME)))
    first_two = maze.MazeEnv.task_info().splits["test"][:2]
    assert sorted((t.task_id, t.sample_idx) for t in records) == [(t, s) for t in first_two for s in range(2)]
    for t in records:
        assert t.status.is_scored and 1 <= t.num_turns <= 2 and sum(t.loss_mask) > 0
    summary = json.loads((out / "summary.json").read_text())["overall"]
    assert summary["scheduled"] == 4 and set(summary["pass_at_k"]) == {"1", "2"}
    for name in ("summary.md", "success_by_env.png", "success_vs_turns.png", "run.json"):
        assert (out / name).exists()


def test_two_environments_with_local_servers(tmp_path):
    """`runner.run` on maze and room, two local servers each: per-env rows plus a pooled overall."""
    config = tiny_config(envs="maze,room", task_ids="3", horizon=100, out_dir=str(tmp_path))
    config.env.num_servers = 2
    summary = runner.run(config)
    assert sorted(summary.per_env) == ["maze", "room"]
    for m in summary.per_env.values():  # the oracle solves every test task given room
        assert (m.scheduled, m.success.numerator) == (3, 3) and m.mean_score is not None
    assert summary.overall.scheduled == 6 and summary.overall.mean_score is None  # scales may differ
    records = list(read_jsonl(str(tmp_path / runner.TRAJECTORIES_NAME)))
    assert sorted({t.env for t in records}) == ["maze", "room"] and len(records) == 6
    assert "| room | 3 |" in (tmp_path / "summary.md").read_text()


def test_token_protected_servers_get_the_configured_token(tmp_path):
    """`env.auth_token` reaches every request of a job, for given URLs and for local servers."""
    with LocalServers(["room"], auth_token="s3cret") as servers:
        url = f"room={servers.servers[0].url}"
        refused = tiny_config(envs="room", task_ids="2", horizon=20, out_dir=str(tmp_path / "no_token"))
        refused.env.urls = url
        with pytest.raises(EnvServerError, match="HTTP 401"):
            runner.run(refused)
        given = tiny_config(envs="room", task_ids="2", horizon=20, out_dir=str(tmp_path / "given"))
        given.env.urls, given.env.auth_token = url, "s3cret"
        assert runner.run(given).overall.success.numerator == 2  # the oracle solves both
    local = tiny_config(envs="room", task_ids="2", horizon=20, out_dir=str(tmp_path / "local"))
    local.env.auth_token = "t0ken"  # the job's own servers require it, and its pool sends it
    assert runner.run(local).overall.success.numerator == 2
