"""Trajectory records: JSONL round trip, crash-safe reading, and the token batch layout."""

import dataclasses
import json

import numpy as np
import pytest

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.batch import bucket, length_grouped_batches, make_token_batch
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl, truncate_jsonl, write_jsonl


def _trajectory(task_id=3, group_id=7, reward=1.0, status="success"):
    # prompt(3) | policy turn(2) | env(2) | policy turn(3)
    return Trajectory(
        task_id=task_id,
        env="maze",
        group_id=group_id,
        token_ids=[5, 6, 7, 20, 21, 8, 9, 22, 23, 24],
        loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
        logprobs=[0, 0, 0, -0.5, -0.1, 0, 0, -0.2, -0.3, -0.05],
        turn_spans=[(3, 5), (7, 10)],
        turn_rewards=[0.0, reward],
        reward=reward,
        status=status,
        text="...",
    )


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    path = str(tmp_path / "t.jsonl")
    original = [_trajectory(), _trajectory(task_id=4, reward=0.0, status="max_turns")]
    write_jsonl(path, original)
    loaded = list(read_jsonl(path))
    assert loaded == original
    assert loaded[1].status is EpisodeStatus.MAX_TURNS
    assert loaded[0].turn_spans == [(3, 5), (7, 10)]


def test_torn_last_line_is_skipped_but_corruption_elsewhere_is_an_error(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(str(path), [_trajectory(), _trajectory(task_id=5)])
    with open(path, "a") as f:
        f.write(json.dumps(_trajectory(task_id=6).to_json())[:40])  # killed mid-write
    assert [t.task_id for t in read_jsonl(str(path))] == [3, 5]
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{broken", lines[1]]) + "\n")
    with pytest.raises(json.JSONDecodeError):
        list(read_jsonl(str(path)))


def test_a_full_write_that_fails_midway_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(str(path), [_trajectory(task_id=1)], append=False)

    def records():
        yield _trajectory(task_id=2)
        raise KeyboardInterrupt  # the writer is stopped after one record

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(str(path), records(), append=False)
    assert [t.task_id for t in read_jsonl(str(path))] == [1]
    write_jsonl(str(path), [_trajectory(task_id=2), _trajectory(task_id=3)], append=False)
    assert [t.task_id for t in read_jsonl(str(path))] == [2, 3] and not (tmp_path / "t.jsonl.tmp").exists()


def test_truncate_keeps_the_steps_before_the_restored_one_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "t.jsonl"
    # (train_step, policy_version): checkpoint at step 2, step 2 was played before a kill; asynchronous
    # RL writes steps whose episodes an older policy sampled (step 1's record 3 from version 0)
    steps = [(0, 0), (0, 0), (1, 1), (1, 0), (2, 1), (2, 2)]
    write_jsonl(str(path), [dataclasses.replace(_trajectory(task_id=i), train_step=s, policy_version=v)
                            for i, (s, v) in enumerate(steps)])
    with open(path, "a") as f:
        f.write('{"task_id": 9')  # killed mid-write
    truncate_jsonl(str(path), before_step=2)
    assert [(t.task_id, t.train_step) for t in read_jsonl(str(path))] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert path.read_text().endswith("\n") and not (tmp_path / "t.jsonl.tmp").exists()
    truncate_jsonl(str(tmp_path / "missing.jsonl"), before_step=2)  # a first run has nothing to cut
    assert not (tmp_path / "missing.jsonl").exists()


def test_mismatched_lengths_are_rejected():
    record = _trajectory().to_json()
    record["loss_mask"] = record["loss_mask"][:-1]
    with pytest.raises(ValueError, match="same length"):
        Trajectory.from_json(record)


def test_token_batch_puts_the_reward_on_the_last_policy_token_and_pads_inertly():
    a = _trajectory(group_id=11, reward=1.0)
    b = _trajectory(group_id=11, reward=0.5)
    c = _trajectory(group_id=2, reward=0.25)
    c.token_ids, c.loss_mask, c.logprobs = c.token_ids[:7], c.loss_mask[:7], c.logprobs[:7]
    c.turn_spans, c.turn_rewards = c.turn_spans[:1], [0.25]
    batch = make_token_batch([a, b, c], batch_size=4)
    assert batch.shape == (4, 16)
    rewards = np.asarray(batch.token_rewards)
    assert rewards[0, 9] == 1.0 and rewards[0].sum() == 1.0
    assert rewards[1, 9] == 0.5
    assert rewards[2, 4] == 0.25 and rewards[2].sum() == 0.25  # last policy token of the short one
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 2])  # padding row: its own group
    assert np.asarray(batch.loss_mask)[3].sum() == 0
    np.testing.assert_array_equal(batch.positions[2], list(range(7)) + [-1] * 9)


def test_each_turn_reward_sits_on_its_turns_last_policy_token():
    dense = _trajectory(reward=0.75)
    dense.turn_rewards = [0.25, 0.5]  # e.g. SciWorld's score deltas
    outcome_only = _trajectory(reward=1.0)  # a dataset record: no per-turn rewards, an outcome
    outcome_only.turn_rewards = [0.0, 0.0]
    unstepped = _trajectory(reward=0.25, status="token_budget")  # the last turn was never sent
    unstepped.turn_rewards = [0.25]
    batch = make_token_batch([dense, outcome_only, unstepped])
    rewards = np.asarray(batch.token_rewards)
    want = np.zeros((3, 16), np.float32)
    want[0, [4, 9]] = [0.25, 0.5]
    want[1, 9] = 1.0
    want[2, 4] = 0.25
    np.testing.assert_array_equal(rewards, want)
    np.testing.assert_array_equal(batch.scores, [0.75, 1.0, 0.25])


def test_turn_spans_outside_the_tokens_are_rejected():
    record = _trajectory().to_json()
    record["turn_spans"] = [(3, 5), (7, 12)]
    with pytest.raises(ValueError, match="turn span"):
        Trajectory.from_json(record)
    record = _trajectory().to_json()
    record["turn_rewards"] = [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="turn_rewards"):
        Trajectory.from_json(record)


def test_bucket_is_the_smallest_power_of_two_or_one_and_a_half_times_one_at_least_the_length():
    assert [bucket(n) for n in (1, 16, 17, 24, 25, 100, 128, 129, 300, 385)] == [16, 16, 24, 24, 32, 128, 128, 192, 384, 512]
    assert bucket(5, minimum=64) == 64 and bucket(65, minimum=64) == 96


def test_length_grouped_batches_cover_every_row_once_and_pad_less():
    lengths = np.random.default_rng(0).lognormal(6.4, 0.35, size=203).astype(int)  # like Maze's 350-1400 demos
    batches = length_grouped_batches(lengths, 16, np.random.default_rng(1), window=4)
    assert sorted(np.concatenate(batches)) == list(range(203))
    assert sorted(len(b) for b in batches)[1:] == [16] * 12  # one short batch: the data's tail
    for b in batches:  # a batch is a run of one window's sorted rows: nothing of its window lies between its ends
        assert list(lengths[b]) == sorted(lengths[b])
    padded = sum(bucket(lengths[b].max()) * len(b) for b in batches)
    plain = length_grouped_batches(lengths, 16, np.random.default_rng(1), window=1)
    assert sorted(np.concatenate(plain)) == list(range(203))
    assert padded < 0.85 * sum(bucket(lengths[b].max()) * len(b) for b in plain) < 0.85 * bucket(lengths.max()) * 203
    with pytest.raises(ValueError, match="window must be >= 1"):
        length_grouped_batches(lengths, 16, np.random.default_rng(1), window=0)
