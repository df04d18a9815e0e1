"""Replayed prefixes in the rollout engine (`RolloutEngine.run(replay=...)`) against real servers.

An episode starts k turns into its task's oracle demonstration: the k actions are sent to the
real session, their text and the environment's answers join the prompt with loss_mask 0, and the
policy plays on from the state they left. A scripted policy that plays the rest of the oracle's
actions solves the task in exactly the turns left (so the replayed state is the real one); the
ids are the demonstration's, which SFT trains on, and the chat template's own rendering of the
conversation. A tiny random decoder shows the slot engine prefilling a group's replayed prompt
once, the turn-batched engine's trajectories token for token, and the group packed as one prefix
tree with the replayed prefix laid out once, scored as the plain rows are.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from agentgym_jax.aio import run_sync
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.job.play import rollout_metrics
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.demonstrations import ACTION_ONLY, demonstration_trajectory, play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.packing import pack_groups, prefix_tree
from agentgym_jax.sampling.sampler import Sampler, SamplerWork
from agentgym_jax.train import scoring
from environments.room import env as room
from tests.servers import start_server
from tests.test_rollout import ScriptedSampler, random_params
from tests.updates import update as make_update

# env -> (a training task with a few oracle turns, how its oracle writes actions, the oracle, function calling)
ENVS = {
    "room": (1, ACTION_ONLY, "", False),  # 6 moves
    "textcraft": (2, ACTION_ONLY, "", False),  # a depth-2 goal: 4 actions
    "academia": (5, "{action}", "tool_call", True),  # 3 `<tool_call>` replies, answered as tool messages
}


@pytest.fixture(scope="module")
def framing(tmp_path_factory) -> ChatFraming:
    folder = bt.build_tokenizer(tmp_path_factory.mktemp("tok"), [room.INSTRUCTION], vocab_size=1024)
    return ChatFraming(load_tokenizer(folder))


def demonstrate(url: str, task: int, action_format: str, oracle: str, tools: bool, framing: ChatFraming):
    """The oracle's episode of `task` as the job's demonstrations play it, and its trajectory."""
    async def play():
        async with EnvPool(url) as pool:
            [episode] = await play_oracle_episodes(pool, [task], horizon=30, action_format=action_format, oracle=oracle)
            return episode, await pool.tasks()

    episode, info = run_sync(play())
    assert episode.status is EpisodeStatus.SUCCESS
    demo = demonstration_trajectory(framing, info, episode, group_id=0, tools=info.metadata.get("tools", []) if tools else None)
    return episode, demo, info


@pytest.mark.parametrize("env", sorted(ENVS))
def test_replayed_turns_are_the_demonstrations_prefix_masked_and_the_policy_plays_on(env, framing, qwen3_tokenizer_dir):
    task, action_format, oracle, tools = ENVS[env]
    if tools:  # function calling needs a template that writes tools: Qwen3's
        framing = ChatFraming(load_tokenizer(qwen3_tokenizer_dir))
    config = RolloutConfig(group_size=2, max_tokens_per_turn=256, max_response_length=100_000, tool_calls=tools)
    with start_server(env) as url:
        episode, demo, info = demonstrate(url, task, action_format, oracle, tools, framing)
        actions = [turn.action for turn in episode.turns]
        k = len(actions) - 2  # the policy has two turns to play
        scripted = ScriptedSampler(framing, [actions[k:]] * 2, action_format="{}")
        scripted.config = dataclasses.replace(scripted.config, max_new_tokens=256)
        with RolloutEngine(scripted, framing, EnvPool(url), info, config) as engine:
            trajectories = engine.run(None, [task], 2, jax.random.key(0), policy_version=0, replay=[actions[:k]])
    prefix = demo.turn_spans[k][0]  # the demonstration's ids before its (k+1)-th action
    for t in trajectories:
        # The rest of the oracle's actions solve the task from the replayed state, in the turns left.
        assert t.status is EpisodeStatus.SUCCESS and t.num_turns == 2 and t.replay_turns == k
        assert t.token_ids == demo.token_ids and t.turn_spans == demo.turn_spans[k:]
        assert t.loss_mask == [0] * prefix + demo.loss_mask[prefix:]  # the demonstration's, less the replayed turns
        assert not any(t.logprobs[:prefix]) and all(t.logprobs[i] == -0.5 for s, e in t.turn_spans for i in range(s, e))
        assert t.turn_rewards == demo.turn_rewards[k:] and t.reward == sum(demo.turn_rewards[k:])
        assert t.invalid_actions == 0
    metrics = rollout_metrics(trajectories)
    assert metrics["turns"] == 2 and metrics["response_tokens"] == sum(e - s for s, e in trajectories[0].turn_spans)
    batch = make_token_batch(trajectories)  # what the trainer scores: no replayed id carries loss or a log-prob
    assert not np.asarray(batch.loss_mask)[:, :prefix].any() and not np.asarray(batch.old_logprobs)[:, :prefix].any()
    if env == "room":  # the chat template's own rendering of the replayed conversation
        game = room.RoomEnv()
        messages = [{"role": "user", "content": f"{info.instruction}\n\n{game.reset(task)}"}]
        for action in actions[:k]:
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": game.step(action.removeprefix("Action: ")).observation}]
        reference = framing.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)
        assert trajectories[0].token_ids[:prefix] == list(reference)


def test_a_replay_longer_than_the_task_ends_the_episode_without_a_policy_turn(framing):
    task, action_format, _, _ = ENVS["room"]
    config = RolloutConfig(group_size=1, max_tokens_per_turn=16)
    with start_server("room") as url:
        episode, _, info = demonstrate(url, task, action_format, "", False, framing)
        actions = [turn.action for turn in episode.turns]
        with RolloutEngine(ScriptedSampler(framing, [["move up"]]), framing, EnvPool(url), info, config) as engine:
            [t] = engine.run(None, [task], 3, jax.random.key(0), policy_version=0, replay=[actions])
            with pytest.raises(ValueError, match="replay has 2 action lists for 1 tasks"):
                engine.run(None, [task], 3, jax.random.key(0), policy_version=0, replay=[actions, actions])
    # The last oracle action reached the goal during the replay: no state to play from, nothing scored.
    assert t.status is EpisodeStatus.INFRA_ERROR and t.num_turns == 0 and not any(t.loss_mask)
    assert t.replay_turns == len(actions) - 1 and t.reward == 0.0


@pytest.fixture(scope="module")
def sampler(framing) -> tuple[Sampler, ModelConfig, object]:
    """A tiny random decoder's sampler: 4 rows, a prompt with 3 replayed moves (~210 ids) in the 256 chunk bucket."""
    model = ModelConfig.small(vocab_size=len(framing.tokenizer))
    config = RolloutConfig(max_tokens_per_turn=8).sampling_config(framing)
    sampler = Sampler.for_decoder(model, config, max_cache_len=512, batch_buckets=(4,), chunk_buckets=(128, 256),
                                  cache_buckets=(512,))
    return sampler, model, random_params(model, 0.02)


def test_slot_engine_prefills_a_replayed_prompt_once_and_the_group_packs_it_once(framing, sampler):
    """2 episodes of a task replaying 3 oracle moves, sampled at temperature 1 by a random decoder:
    the slot engine gives the turn-batched engine's trajectories token for token, both with one
    prefill of the replayed prompt (the second episode copies it); the group's two rows, packed as a
    prefix tree, share the whole replayed prompt and score as the plain rows do."""
    sampler, model, params = sampler
    task, action_format, _, _ = ENVS["room"]
    base = RolloutConfig(group_size=2, max_tokens_per_turn=8, straggler_wait_s=0.0)
    runs = {}
    with start_server("room") as url:
        episode, demo, info = demonstrate(url, task, action_format, "", False, framing)
        replay = [[turn.action for turn in episode.turns[:3]]]
        for name, config in (("turns", base), ("slots", dataclasses.replace(base, num_slots=2, decode_chunk=4))):
            sampler.work = SamplerWork()
            with RolloutEngine(sampler, framing, EnvPool(url), info, config) as engine:
                runs[name] = engine.run(params, [task], 2, jax.random.key(4), policy_version=0, replay=replay)
                runs[name + "_stats"] = engine.last_stats
    prefix = demo.turn_spans[3][0]
    for a, b in zip(runs["turns"], runs["slots"], strict=True):
        assert a.replay_turns == b.replay_turns == 3 and a.turn_spans[0][0] == prefix
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.status == b.status
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    one_prefill = 256  # one row x the replayed prompt's chunk bucket, the other row copied
    assert runs["slots_stats"].prompt_tokens_computed == runs["turns_stats"].prompt_tokens_computed == one_prefill
    assert runs["slots_stats"].prompt_tokens == 2 * prefix
    rows = [np.asarray(t.token_ids) for t in runs["turns"]]
    assert rows[0].tolist() != rows[1].tolist()  # the two samples differ after the prefix
    tokens, _, _, origins = prefix_tree(rows)
    shared = int(np.sum(origins[0][: min(map(len, rows))] == origins[1][: min(map(len, rows))]))
    assert shared >= prefix and len(tokens) == len(rows[0]) + len(rows[1]) - shared
    # The group as the RL step trains it (`algo.shared_prefix`): one prefix tree with the replayed
    # prompt laid out once and out of the loss, every policy token scored as the plain rows score it.
    batch = make_token_batch(runs["turns"])
    packed = pack_groups(batch, rows_per_unit=2)
    assert int((np.asarray(packed.layout.positions) >= 0).sum()) == len(tokens)
    mask = np.asarray(packed.loss_mask) > 0
    assert mask.any() and not mask[:, :prefix].any()
    forward = make_update(model).forward
    score = jax.jit(lambda batch: scoring.score(params, batch, forward)[0])
    np.testing.assert_allclose(np.asarray(score(packed))[mask], np.asarray(score(batch))[mask], rtol=1e-5, atol=1e-6)
