"""Online RL over an agent program (`env.agent`, docs/agents.md): the agent plays each episode
through the job's in-process gateway, which serves the newest weights.

The agents (tests/agent_programs.py) are written with the `openai` package alone and play real
room servers on 127.0.0.1; the policy is the quickstart's tiny random decoder. The jobs run
in-process (`rl_loop.run`), except the one killed and resumed and the one on two processes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import ml_collections
import pytest

from agentgym_jax.aio import run_sync
from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.eval import runner
from agentgym_jax.gateway.agents import AgentSpec, read_answer, run_agent
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.train import rl_loop
from agentgym_jax.train.metrics import read_metrics
from configs import agent_movie
from configs import eval as eval_config
from configs import quickstart
from tests.agent_programs import LIES
from tests.rl_runs import REPO, TINY_RL_JOB, launch_command, with_compile_cache
from tests.test_multihost import Processes

AGENT = "tests.agent_programs:play"


def agent_job(workdir: pathlib.Path, **overrides) -> ml_collections.ConfigDict:
    """The tiny RL job of tests/rl_runs.py with an agent program as its environment."""
    config = quickstart.get_config()
    settings = {**TINY_RL_JOB, "workdir": str(workdir), "train.steps": 2, "train.checkpoint_every": 1,
                "horizon_schedule.steps_per_stage": 1, "sft.epochs": 1, "env.agent": AGENT,
                "env.agent_timeout_s": 120.0, **overrides}
    for key, value in settings.items():
        *sections, name = key.split(".")
        section = config
        for s in sections:
            section = section[s]
        section[name] = eval(value) if isinstance(value, str) and value.startswith("(") else value  # noqa: S307
    return config


def by_step(workdir: pathlib.Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(str(workdir / "metrics.jsonl"))}


def test_answers_are_read_as_documented_and_every_other_answer_is_an_infra_error():
    read = lambda answer: read_answer(answer, (-1.0, 1.0), success_threshold=1.0)  # noqa: E731
    assert read(1.0).status is EpisodeStatus.SUCCESS and read(0.5).status is EpisodeStatus.FAILURE
    assert read({"reward": 0.5, "success": True}).status is EpisodeStatus.SUCCESS
    assert read({"reward": 0.0, "status": "max_turns", "metadata": {"turns": 3}}) == read_answer(
        {"reward": 0, "status": "max_turns", "metadata": {"turns": 3}}, (-1, 1), 1.0)
    for lie, words in zip(LIES, ["outside env.agent_reward_range", "finite number", "success must be true or false",
                                 "finite number", "unknown fields", "finite number"]):
        outcome = read(lie)
        assert outcome.status is EpisodeStatus.INFRA_ERROR and words in outcome.error and outcome.reward == 0.0, lie
    assert "with status" in read({"reward": 1.0, "success": False, "status": "success"}).error
    assert "not one of" in read({"reward": 1.0, "status": "won"}).error


def test_bad_agent_settings_are_one_line_config_errors():
    env = quickstart.get_config().env
    for key, value, words in [("agent", "tests.agent_programs:nothing_here", "has no attribute 'nothing_here'"),
                              ("agent", "no_such_module_x:play", "No module named"),
                              ("agent_workers", "fibers", "threads, processes"),
                              ("agent_kwargs", "[1]", "JSON object"), ("agent_reward_range", (1.0, 0.0), "low < high")]:
        bad = ml_collections.ConfigDict({**env.to_dict(), "agent": AGENT, key: value})
        with pytest.raises(ConfigError, match=words):
            AgentSpec.of(bad)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_hanging_or_raising_agent_ends_infra_error_on_threads_and_in_processes(workers):
    """A hung agent is given up after `agent_timeout_s` (a process agent is killed, with its
    children); an agent that raises or exits non-zero ends its episode, not the caller."""
    def run(target, timeout=60.0, **kwargs):
        spec = AgentSpec(target, workers, timeout, {"model": "policy"})
        return run_sync(run_agent(spec, 3, "http://127.0.0.1:9/v1", "key", kwargs, 1.0))

    start = time.monotonic()
    hung = run("tests.agent_programs:sleeps", timeout=1.0, seconds=3600)
    assert hung.status is EpisodeStatus.INFRA_ERROR and "did not return within env.agent_timeout_s=1 s" in hung.error
    assert time.monotonic() - start < 30
    raised = run("tests.agent_programs:raising")  # its first request fails: nothing listens on port 9
    assert raised.status is EpisodeStatus.INFRA_ERROR and "APIConnectionError" in raised.error
    assert run("tests.agent_programs:sleeps", seconds=0).reward == 0.25  # the task id and kwargs arrive
    if workers == "processes":  # a command line, its answer on the last line
        command = f"{sys.executable} -c \"import sys; print('noise'); print(0.75 if '--task=3' in sys.argv else 0)\""
        assert run(command).reward == 0.75
        assert "exited 3" in run(f"{sys.executable} -c \"import sys; sys.exit(3)\"").error


@pytest.fixture(scope="module")
def online_job(tmp_path_factory):
    """An online job, one step off and overlapped (`max_staleness=1`, not lock-step, the decoupled
    correction): 2 steps of 2 tasks x 3 episodes. Batch 0 (horizon 1) is played with the first
    weights; batch 1 (horizon 2) starts with them too, and its episodes, after their first turn,
    wait for the update of step 0, so their second turn is sampled with the new weights. The third
    episode of each group misbehaves (`tests/agent_programs.mixed`: raises, lies, or restarts its
    conversation); the others record what the gateway told them."""
    root = tmp_path_factory.mktemp("online")
    records = root / "records"
    records.mkdir()
    config = agent_job(root / "job", **{
        "env.agent": "tests.agent_programs:mixed", "rollout.group_size": 3, "env.agent_conversations": 2,
        "rollout.max_staleness": 1, "rollout.lock_step": False, "algo.decoupled_ppo": True,
        "eval.num_tasks": 1, "eval.horizon": 1,  # one turn: nothing waits for an update
        "algo.entropy_coef": 0.1, "optim.lr": 0.01,  # every update moves the policy, whatever the (~0) rewards
        # batch 1's episodes wait for step 0's update (its compilation included): room for a loaded machine
        "env.agent_timeout_s": 600.0,
        "env.agent_kwargs": json.dumps({"record_dir": str(records), "wait_for_update_s": 600.0})})
    summary = rl_loop.run(config)
    return root / "job", records, summary


def test_the_online_job_trains_on_exactly_what_the_gateway_sampled(online_job):
    workdir, records, summary = online_job
    assert set(summary) >= {"success_before", "success_after"}
    sent = {}
    for path in records.glob("*.json"):  # every conversation the agents were answered in, as they were told it
        ids, mask, logprobs = [], [], []
        for turn in json.loads(path.read_text())["turns"]:
            ids += turn["prompt_token_ids"] + turn["completion_token_ids"]
            mask += [0] * len(turn["prompt_token_ids"]) + [1] * len(turn["completion_token_ids"])
            logprobs += [0.0] * len(turn["prompt_token_ids"]) + turn["completion_logprobs"]
        sent[tuple(ids)] = (mask, logprobs)
    played = [t for t in read_jsonl(str(workdir / "trajectories.jsonl")) if t.sample_idx < 2]
    assert len(played) == 2 * 2 * 2  # steps x tasks x well-behaved episodes
    for t in played:
        mask, logprobs = sent[tuple(t.token_ids)]
        assert t.loss_mask == mask and t.logprobs == logprobs  # token for token, log-prob for log-prob
    # Step 0 trains on tokens of version 0 with the params of version 0: the trainer's log-probs are the sampler's.
    assert by_step(workdir)[1]["logprob_gap"] < 1e-5
    assert {v for t in played if t.train_step == 0 for v in t.token_versions} == {-1, 0}


def test_a_weight_swap_mid_conversation_shows_in_the_token_versions_and_is_corrected(online_job):
    workdir, _, _ = online_job
    swapped = [t for t in read_jsonl(str(workdir / "trajectories.jsonl")) if t.train_step == 1 and t.sample_idx < 2]
    assert len(swapped) == 4
    for t in swapped:
        versions = [v for v in t.token_versions if v >= 0]
        first = t.turn_spans[0][1] - t.turn_spans[0][0]
        assert t.num_turns == 2 and set(versions[:first]) == {0} and set(versions[first:]) == {1}
        assert t.policy_version == 0  # its oldest token's
    step = by_step(workdir)[2]
    assert step["staleness_max"] == 1 and step["staleness_1"] == 1.0
    # The behaviour policy (the sampler's log-probs: version 0 for the first turns) is not the proximal one
    # (the trainer at version 1): the decoupled correction weighs each token by their ratio.
    assert step["logprob_gap"] > 1e-3 and step["is_weight_mean"] > 0 and math.isfinite(step["is_weight_max"])


def test_misbehaving_agents_end_as_documented_and_the_job_goes_on(online_job):
    workdir, _, _ = online_job
    episodes = [json.loads(line) for line in (workdir / "agent_episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 3
    odd = [e for e in episodes if e["sample_idx"] == 2]
    for e in odd:
        if e["error"]:
            assert e["status"] == "infra_error" and e["conversations"] == 1 and e["restarts"] == 0
            assert e["error"] in ("the agent raised ValueError: the agent's own bug",
                                  "the agent's reward must be a finite number, got 'high'")
        else:  # restarted: its changed history began a second conversation; both train (agent_conversations=2)
            assert (e["conversations"], e["restarts"], e["dropped"]) == (2, 1, 0) and e["status"] in ("success", "failure")
    trajectories = list(read_jsonl(str(workdir / "trajectories.jsonl")))
    for e in odd:
        mine = [t for t in trajectories if (t.group_id, t.sample_idx) == (e["group_id"], 2)]
        assert len(mine) == e["conversations"] and all(t.status.value == e["status"] for t in mine)
    metrics = by_step(workdir)
    infra = sum(e["status"] == "infra_error" for e in odd)
    assert sorted(metrics) == [1, 2] and sum(m["status/infra_error"] for m in metrics.values()) == infra


def test_an_agent_is_evaluated_with_the_report_of_environment_evaluations(online_job, tmp_path, capfd):
    workdir, _, _ = online_job
    config = eval_config.get_config()
    config.policy, config.envs, config.task_ids, config.group_size = f"checkpoint:{workdir}", "room", "2", 2
    config.temperature, config.horizon, config.out_dir = 1.0, 2, str(tmp_path)
    config.rollout.max_tokens_per_turn, config.rollout.max_cache_len = 8, 512
    config.env.agent = AGENT
    before = {id(a) for a in jax.live_arrays()}
    summary = runner.run(config)
    # Its gateway's rows do not outlive it: the KV cache ([layers, rows, kv heads, slots, head dim]) went at its stop.
    assert [a.shape for a in jax.live_arrays() if id(a) not in before and a.ndim == 5 and a.shape[3] == 512] == []
    written = json.loads((tmp_path / "summary.json").read_text())["overall"]
    assert summary.overall.scheduled == written["scheduled"] == 4
    assert written["success"]["value"] == summary.overall.success.value
    records = list(read_jsonl(str(tmp_path / "trajectories.jsonl")))
    tasks = sorted({t.task_id for t in records})
    assert len(tasks) == 2 and sorted((t.task_id, t.sample_idx) for t in records) == [(t, s) for t in tasks for s in (0, 1)]
    assert all(t.token_ids and sum(t.loss_mask) for t in records)
    assert len((tmp_path / "agent_episodes.jsonl").read_text().splitlines()) == 4
    # Its progress counts the replies the gateway sampled, not zeros (one conversation an episode here).
    last = [line for line in capfd.readouterr().err.splitlines() if " 4/4 episodes" in line][-1]
    turns, tokens = (int(re.search(rf"{k}=(\d+)", last).group(1)) for k in ("turns", "tokens"))
    assert (turns, tokens) == (sum(t.num_turns for t in records), sum(sum(t.loss_mask) for t in records)), last

    # A hanging agent: given up after env.agent_timeout_s, counted in the report's denominator, the run goes on.
    config.env.agent, config.env.agent_timeout_s, config.group_size = "tests.agent_programs:hanging", 3.0, 1
    config.out_dir, config.max_attempts = str(tmp_path / "hanging"), 1
    hung = runner.run(config)
    assert hung.overall.scheduled == 2 and hung.overall.infra_rate.value == 1.0
    episodes = [json.loads(line) for line in (tmp_path / "hanging" / "agent_episodes.jsonl").read_text().splitlines()]
    assert [e["error"] for e in episodes] == ["the agent did not return within env.agent_timeout_s=3 s"] * 2
    # Its one conversation: recorded (never trained on) if its turn was answered in time, else dropped, counted.
    assert [e["conversations"] + e["dropped"] for e in episodes] == [1, 1]


@pytest.mark.slow
def test_a_killed_online_job_resumes_and_trains_on_no_episode_twice(tmp_path):
    """The agent SIGKILLs the job (its own process: a thread agent) during step 1's episodes, once
    checkpoint 1 is written; the same command resumes at step 1 and finishes (loading what the
    first launch compiled, as a restarted job does)."""
    workdir = tmp_path / "job"
    kwargs = json.dumps({"kill_once_after": str(workdir / "checkpoints" / "1"), "marker": str(tmp_path / "killed")})
    overrides = {k: v for k, v in TINY_RL_JOB.items()} | {
        "workdir": workdir, "train.steps": 2, "train.checkpoint_every": 1, "horizon_schedule.steps_per_stage": 1,
        "sft.epochs": 1, "env.agent": "tests.agent_programs:play", "env.agent_kwargs": kwargs}
    env = with_compile_cache({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": str(REPO)},
                             tmp_path / "jax_cache")
    command = launch_command("configs/quickstart.py", overrides)
    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == -9 and (tmp_path / "killed").exists(), first.stderr[-3000:]
    assert not (workdir / "checkpoints" / "2").exists()
    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0 and "resumed from step 1" in second.stderr, second.stderr[-3000:]
    metrics = read_metrics(str(workdir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2]
    trajectories = list(read_jsonl(str(workdir / "trajectories.jsonl")))
    keys = [(t.train_step, t.group_id, t.sample_idx) for t in trajectories]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2  # steps x tasks x samples, each once
    assert sorted({t.group_id for t in trajectories if t.train_step == 1}) == [2, 3]  # the task cursor: batch 1


@pytest.mark.slow
def test_two_processes_each_play_their_share_with_their_own_agents_and_gateway(tmp_path):
    workdir = tmp_path / "job"
    overrides = {**TINY_RL_JOB, "workdir": workdir, "train.steps": 2, "horizon_schedule.steps_per_stage": 1,
                 "sft.epochs": 1, "rollout.batch_tasks": 4, "env.agent": AGENT}
    with Processes(launch_command("configs/quickstart.py", overrides), tmp_path / "logs", 2) as job:
        p0, p1 = job.wait(900)
    assert "summary: env=room" in p0 and "summary:" not in p1
    shares = [list(read_jsonl(str(workdir / f"trajectories.p{k}.jsonl"))) for k in (0, 1)]
    groups = [{(t.train_step, t.group_id) for t in share} for share in shares]
    assert groups[0] == {(0, 0), (0, 1), (1, 4), (1, 5)} and groups[1] == {(0, 2), (0, 3), (1, 6), (1, 7)}
    for k in (0, 1):  # each process's agents wrote their own episodes, through their own gateway
        episodes = (workdir / f"agent_episodes.p{k}.jsonl").read_text().splitlines()
        assert len(episodes) == 2 * 2 * 2
    assert [m["step"] for m in read_metrics(str(workdir / "metrics.jsonl"))] == [1, 2]


@pytest.mark.slow
def test_the_movie_recipe_trains_a_langchain_agent_and_evaluates_the_openai_one(tmp_path):
    """configs/agent_movie.py shrunk to the tiny random policy: one step of `agents/langchain_tools.py`
    (langchain-openai) on real Movie servers, then `agents/openai_tools.py` evaluated on its checkpoint."""
    config = agent_movie.get_config()
    tiny = {**TINY_RL_JOB, "model.hf_dir": "", "tokenizer.dir": "", "model.family": "qwen2", "model.num_layers": 2,
            "model.num_heads": 4, "model.num_kv_heads": 2, "tokenizer.vocab_size": 1024, "rollout.max_tokens_per_turn": 24,
            "rollout.max_cache_len": 4096,  # the tool block in a tokenizer made of four demonstrations: ~2,000 ids "sft.num_tasks": 4, "horizon_schedule.horizons": "(2,)",
            "algo.num_microbatches": 1, "algo.length_buckets": 1, "eval.temperature": 1.0}
    run = agent_job(tmp_path / "job", **tiny, **{"train.steps": 1, "env.agent": "agents.langchain_tools:play"})
    for section in ("env", "rollout", "sft", "algo"):  # the recipe's own keys, under the tiny ones
        for key, value in config[section].items():
            if f"{section}.{key}" not in tiny and key not in ("agent",):
                run[section][key] = value
    run.env.agent_reward_range = (0.0, 1.0)
    rl_loop.run(run)
    trajectories = list(read_jsonl(str(tmp_path / "job" / "trajectories.jsonl")))
    assert len(trajectories) == 2 * 2 and all(t.env == "movie" for t in trajectories)
    assert all(t.token_ids and sum(t.loss_mask) for t in trajectories)
    assert by_step(tmp_path / "job")[1]["logprob_gap"] < 1e-5
    episodes = [json.loads(line) for line in (tmp_path / "job" / "agent_episodes.jsonl").read_text().splitlines()]
    assert {e["error"] for e in episodes} == {""}, episodes  # langchain's requests are all served

    out = tmp_path / "eval"
    evaluation = eval_config.get_config()
    evaluation.policy, evaluation.envs, evaluation.task_ids = f"checkpoint:{tmp_path / 'job'}", "movie", "2"
    evaluation.env.tasks, evaluation.horizon, evaluation.out_dir = config.env.tasks, 2, str(out)
    evaluation.rollout.max_tokens_per_turn, evaluation.rollout.max_cache_len = 24, 4096
    evaluation.env.agent, evaluation.env.agent_reward_range = "agents.openai_tools:play", (0.0, 1.0)
    summary = runner.run(evaluation)
    assert summary.overall.scheduled == 2 and summary.overall.infra_rate.value == 0.0
