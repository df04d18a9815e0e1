"""mode=sft: the per-environment mixture (counts vs weights, determinism), AgentGym files feeding SFT
with the loss on trained gpt turns only, and a `launch` run whose loss falls and that resumes."""

import collections
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import ml_collections
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout import agentgym_format as agf
from agentgym_jax.train import sft_data
from agentgym_jax.train.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
INSTRUCTION = "You craft items. Answer with Action: craft <item>."


def _item(env, task, success=True):
    """An AgentTraj-L-style item: instruction, an untrained "Ok.", two trained turns (one loss=null)."""
    return {
        "item_id": f"{env}_{task}",
        "success": int(success),
        "conversations": [
            {"from": "human", "loss": None, "value": INSTRUCTION},
            {"from": "gpt", "loss": False, "value": "Ok."},
            {"from": "human", "loss": None, "value": f"Goal: craft item {task} in {env}."},
            {"from": "gpt", "loss": True, "value": f"Action: get wood {task}"},
            {"from": "human", "loss": None, "value": "Got wood."},
            {"from": "gpt", "loss": None, "value": f"Action: craft item {task}"},
        ],
    }


def _schedule_counts(schedule):
    return collections.Counter(env for batch in schedule for env, _ in batch)


def test_mixture_counts_follow_the_weights_within_four_sigma():
    sizes, weights = {"alfworld": 7, "textcraft": 40, "webshop": 3, "wordle": 5}, {"alfworld": 3, "textcraft": 1, "webshop": 0.5, "wordle": 0}
    steps, batch = 200, 16
    schedule = sft_data.mixture_schedule(sizes, weights, batch, steps, seed=0)
    assert len(schedule) == steps and all(len(rows) == batch for rows in schedule)
    counts, n, total = _schedule_counts(schedule), steps * batch, sum(weights.values())
    # Each row picks env e independently with p_e = w_e / sum(w): count_e ~ Binomial(n, p_e).
    for env, w in weights.items():
        p = w / total
        assert abs(counts[env] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (env, counts[env], n * p)
    assert counts["wordle"] == 0  # weight 0: never drawn
    # Within an environment, rows come without replacement: every pass uses each row exactly once.
    for env, size in sizes.items():
        drawn = [i for rows in schedule for e, i in rows if e == env]
        for start in range(0, len(drawn) - size + 1, size):
            assert sorted(drawn[start : start + size]) == list(range(size)), env

    assert sft_data.mixture_schedule(sizes, weights, batch, steps, seed=0) == schedule  # a fixed seed: one schedule
    assert sft_data.mixture_schedule(sizes, weights, batch, steps, seed=1) != schedule
    # Empty weights (the job's default): proportional to each environment's rows, i.e. uniform over rows.
    uniform = _schedule_counts(sft_data.mixture_schedule(sizes, {e: float(s) for e, s in sizes.items()}, batch, steps, 0))
    for env, size in sizes.items():
        p = size / sum(sizes.values())
        assert abs(uniform[env] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), env


@pytest.mark.parametrize(
    "spec, match",
    [("alfworld=2,webshop", "expected 'env=weight"), ("alfworld=-1", "weights >= 0"), ("=2", "expected 'env=weight")],
)
def test_bad_weights_are_clear_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        sft_data.parse_weights(spec)


def test_weights_must_name_exactly_the_data_environments():
    assert sft_data.parse_weights(" webshop=2, alfworld=0.5 ") == {"webshop": 2.0, "alfworld": 0.5}
    with pytest.raises(ConfigError, match=r"names \['webshop'\] but the data has environments \['alfworld', 'webshop'\]"):
        sft_data.mixture_schedule({"webshop": 3, "alfworld": 2}, {"webshop": 1.0}, 4, 2, 0)
    with pytest.raises(ConfigError, match="no environment with rows and a positive weight"):
        sft_data.mixture_schedule({"webshop": 3}, {"webshop": 0.0}, 4, 2, 0)


@pytest.fixture(scope="module")
def framing(tmp_path_factory):
    folder = bt.build_tokenizer(tmp_path_factory.mktemp("chatml"), [INSTRUCTION] * 3, 400, "chatml")
    return ChatFraming(load_tokenizer(folder))


def _masked_runs(trajectory):
    runs, current = [], []
    for token, m in zip(trajectory.token_ids + [None], trajectory.loss_mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs


def test_agentgym_files_feed_sft_with_loss_only_on_trained_gpt_turns(framing, tmp_path):
    agf.write_file(tmp_path / "textcraft.json", [_item("textcraft", 3), _item("textcraft", 4, success=False)])
    agf.write_file(tmp_path / "webshop.json", [_item("webshop", 9)])
    config = ml_collections.ConfigDict(dict(data=dict(
        trajectories="", agentgym=f"{tmp_path / 'textcraft.json'}, {tmp_path / 'webshop.json'}", include_failures=False,
    )))
    rows = sft_data.load_rows(config, framing)
    assert {env: [t.task_id for t in r] for env, r in rows.items()} == {"textcraft": [3], "webshop": [9]}  # failure dropped
    for (t,), task in ((rows["textcraft"], 3), (rows["webshop"], 9)):
        # The loss covers exactly the policy's own ids of the trained gpt turns (content + end of
        # turn, as `assistant_ids` frames a sampled turn), in order; the "Ok." and every human turn are 0.
        expected = [framing.assistant_ids(text).ids for text in (f"Action: get wood {task}", f"Action: craft item {task}")]
        assert _masked_runs(t) == [list(ids) for ids in expected]
        assert sum(t.loss_mask) == sum(len(ids) for ids in expected)

    config.data.include_failures = True
    assert [t.task_id for t in sft_data.load_rows(config, framing)["textcraft"]] == [3, 4]


STEPS, KILLED_AFTER, BATCH = 8, 4, 8


def _launch(workdir, data):
    overrides = {
        "workdir": workdir, "seed": 1, "data.agentgym": data, "data.weights": "textcraft=3,webshop=1",
        "train.steps": STEPS, "train.batch_size": BATCH, "train.checkpoint_every": KILLED_AFTER,
        "train.keep_checkpoints": 3, "optim.lr": 1e-2, "tokenizer.vocab_size": 300,
        "model.num_layers": 1, "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 8,
    }
    command = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/sft.py"]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    # One CPU device (not the suite's 8): half the compile time; sharded updates have their own tests.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_sft_launch_loss_falls_and_an_interrupted_run_resumes_exactly(tmp_path):
    agf.write_file(tmp_path / "textcraft.json", [_item("textcraft", i) for i in range(6)])
    agf.write_file(tmp_path / "webshop.json", [_item("webshop", i) for i in range(4)])
    data = f"{tmp_path / 'textcraft.json'},{tmp_path / 'webshop.json'}"
    run = tmp_path / "run"
    _launch(run, data)
    straight = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    assert all(r["rows/textcraft"] + r["rows/webshop"] == BATCH for r in straight)
    assert straight[-1]["loss"] < 0.6 * straight[0]["loss"], [r["loss"] for r in straight]
    assert (run / "tokenizer" / "tokenizer.json").is_file() and json.loads((run / "config.json").read_text())

    # A kill after checkpoint KILLED_AFTER leaves it and the metrics logged so far; the same
    # command continues from it and takes exactly the uninterrupted run's batches and updates.
    shutil.rmtree(run / "checkpoints" / str(STEPS))
    _launch(run, data)
    records = read_metrics(str(run / "metrics.jsonl"))  # cut back to the checkpoint, then replayed
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and records[:KILLED_AFTER] == straight[:KILLED_AFTER]
    for a, b in zip(straight[KILLED_AFTER:], records[KILLED_AFTER:]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
