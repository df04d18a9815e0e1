"""The rollout engine and oracle demonstrations against real Maze servers on 127.0.0.1.

A tiny random decoder (`ModelConfig.small`) with a tokenizer built in a tmp dir samples the
turns; one sampler (fixed buckets, so it compiles once) is shared by every test. The golden test
records what the sampler produced and what the server returned, stores the trajectories as JSONL,
reloads them and checks them token for token. Success and failure need a policy that plays well
or badly on purpose: a scripted sampler emits the oracle's actions (or a useless shuffle).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.aio import run_sync
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models import decoder
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout import demonstrations
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.trajectory import read_jsonl, write_jsonl
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler, SamplerWork, StopReason, TurnOutput
from environments.maze import env as maze
from tests.servers import start_server
from tests.test_env_pool import counting_pool

S = EpisodeStatus
MAX_NEW = 8  # per-turn token limit of the shared sampler


@pytest.fixture(scope="module")
def framing(tmp_path_factory) -> ChatFraming:
    folder = bt.build_tokenizer(tmp_path_factory.mktemp("tok"), [maze.INSTRUCTION], vocab_size=1024)
    return ChatFraming(load_tokenizer(folder))


@pytest.fixture(scope="module")
def model(framing):
    """A random `ModelConfig.small` decoder (N(0, 0.02) matrices, unit norms)."""
    config = ModelConfig.small(vocab_size=len(framing.tokenizer))
    return config, random_params(config, 0.02)


def random_params(config: ModelConfig, scale: float):
    """Weights drawn on the host from the shapes `init_params` gives (N(0, scale) matrices, unit
    norms), which skips compiling the Flax init."""
    shapes = jax.eval_shape(lambda key: decoder.init_params(config, key), jax.random.key(0))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(leaf.shape, leaf.dtype)
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def sampler(framing, model) -> Sampler:
    """One sampler for every test, with fixed buckets so that it compiles once: 4 rows, the
    prompt (~200 ids) in the 256 chunk bucket, observations in the 128 one, one cache bucket."""
    return _fixed_bucket_sampler(framing, model)


@pytest.fixture(scope="module")
def whole_batch_sampler(framing, model) -> Sampler:
    """The shared sampler's buckets, but appends and decodes always run all 4 rows: its shapes
    do not depend on how many rows take part, which with continuous batching is a matter of
    which environment answered first."""
    return _fixed_bucket_sampler(framing, model, fill_buckets=(4,), decode_buckets=(4,))


def _fixed_bucket_sampler(framing, model, **buckets) -> Sampler:
    config = RolloutConfig(max_tokens_per_turn=MAX_NEW).sampling_config(framing)
    return Sampler.for_decoder(model[0], config, max_cache_len=2048, batch_buckets=(4,), chunk_buckets=(128, 256),
                               cache_buckets=(2048,), **buckets)


@pytest.fixture(scope="module")
def maze_url():
    with start_server("maze") as url:
        yield url


@pytest.fixture(scope="module")
def task_info():
    return maze.MazeEnv.task_info()


class RecordingSampler:
    """The real sampler, plus every turn it produced and which rows took part."""

    def __init__(self, sampler: Sampler):
        self.sampler, self.config, self.work = sampler, sampler.config, sampler.work
        self.turns: list[tuple[np.ndarray, TurnOutput]] = []

    def sampling_params(self, params):
        return self.sampler.sampling_params(params)

    def prefill(self, params, prompts):
        return self.sampler.prefill(params, prompts)

    def append(self, params, state, chunks, live=None):
        return self.sampler.append(params, state, chunks, live)

    def generate(self, params, state, rng, limit=None, **kw):
        live = np.asarray(state.live)[: state.num_rows].copy()
        state, turn = self.sampler.generate(params, state, rng, limit, **kw)
        self.turns.append((live, turn))
        return state, turn


class RecordingPool(EnvPool):
    """A real pool that keeps every observation the server returned, per slot."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.observations: dict[int, list[str]] = {}
        self.rewards: dict[int, list[float]] = {}

    async def reset(self, slot, data_idx, **kwargs):
        result = await super().reset(slot, data_idx, **kwargs)
        self.observations[slot], self.rewards[slot] = [result.observation], []
        return result

    async def step(self, slot, action):
        result = await super().step(slot, action)
        self.observations[slot].append(result.observation)
        self.rewards[slot].append(result.reward)
        return result


def policy_spans(trajectory):
    return [trajectory.token_ids[s:e] for s, e in trajectory.turn_spans]


def test_golden_trajectories_are_token_exact(framing, model, sampler, maze_url, task_info, tmp_path):
    tokenizer, eot = framing.tokenizer, framing.end_of_turn_ids
    recorder, pool = RecordingSampler(sampler), RecordingPool(maze_url)
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, straggler_wait_s=0.0)
    with RolloutEngine(recorder, framing, pool, task_info, config) as engine:
        produced = engine.run(model[1], [3, 7], 3, jax.random.key(1), policy_version=11, group_offset=5)
    path = tmp_path / "rollout.jsonl"
    write_jsonl(str(path), produced, append=False)
    trajectories = list(read_jsonl(str(path)))

    assert [(t.task_id, t.group_id, t.sample_idx) for t in trajectories] == [(3, 5, 0), (3, 5, 1), (7, 6, 0), (7, 6, 1)]
    assert all(t.policy_version == 11 and t.env == "maze" for t in trajectories)
    batch = make_token_batch(trajectories)
    for row, t in enumerate(trajectories):
        assert t.status == S.MAX_TURNS and t.num_turns == 3  # a random model never reaches the goal in 3 moves
        # Policy spans: exactly the sampler's tokens and log-probs for this row, turn by turn.
        sampled = [(turn.tokens[row, : turn.count[row]], turn.logprobs[row, : turn.count[row]])
                   for live, turn in recorder.turns if live[row]]  # fmt: skip
        assert [list(ids) for ids, _ in sampled] == policy_spans(t)
        for (s, e), (_, logprobs) in zip(t.turn_spans, sampled):
            np.testing.assert_array_equal(np.asarray(t.logprobs[s:e], np.float32), logprobs)
        # The prompt: the chat template's own rendering of instruction + first observation.
        observations = pool.observations[row]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": task_info.instruction + "\n\n" + observations[0]}],
            tokenize=True, return_dict=False, add_generation_prompt=True,
        )
        assert t.token_ids[: len(prompt)] == list(prompt)
        assert t.turn_spans[0][0] == len(prompt)
        # Environment spans: the continuation ids of the observations the server returned; the last
        # observation is not appended, so the sequence ends with the last policy token.
        for k in range(t.num_turns - 1):
            closed = t.token_ids[t.turn_spans[k][1] - 1] in eot
            expected = (() if closed else eot) + framing.continuation_ids(observations[k + 1]).ids
            assert t.token_ids[t.turn_spans[k][1] : t.turn_spans[k + 1][0]] == list(expected)
        assert len(observations) == t.num_turns + 1 and t.turn_spans[-1][1] == len(t.token_ids)
        # loss_mask is 1 exactly on the policy spans; log-probs are 0 elsewhere.
        in_spans = np.zeros(len(t.token_ids), int)
        for s, e in t.turn_spans:
            in_spans[s:e] = 1
        assert t.loss_mask == list(in_spans)
        assert not np.any(np.asarray(t.logprobs)[in_spans == 0])
        # Rewards: the server's step rewards; the outcome sits on the last policy token.
        assert t.turn_rewards == pool.rewards[row] and t.reward == sum(pool.rewards[row])
        last = t.turn_spans[-1][1] - 1
        assert np.flatnonzero(np.asarray(batch.loss_mask[row])).max() == last
        expected_rewards = np.zeros(batch.shape[1], np.float32)
        expected_rewards[last] = t.reward
        np.testing.assert_array_equal(np.asarray(batch.token_rewards[row]), expected_rewards)
        # Decoding: the stored text is the decoding of the ids, pieces in order.
        assert t.text == tokenizer.decode(t.token_ids)
        assert t.experts == []  # kept only with `record_experts`
        assert t.text.startswith(tokenizer.decode(prompt))
        position = 0
        for observation in observations[1:-1]:
            position = t.text.index(observation, position) + len(observation)
        assert t.timings["sample_s"] > 0 and t.timings["env_s"] > 0
    stats = engine.last_stats
    assert stats.turns == 12 and stats.sampler_busy_s + stats.sampler_wait_s <= stats.wall_s


def test_horizon_is_respected_and_nothing_recompiles(framing, model, whole_batch_sampler, maze_url, task_info):
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW)
    compilations = []
    with RolloutEngine(whole_batch_sampler, framing, EnvPool(maze_url), task_info, config) as engine:
        for horizon in (2, 3):  # the first run compiles (if no test before did); the second must not
            listener = lambda event, seconds, **kw: compilations.append(event)  # noqa: E731
            if horizon == 3:
                jax.monitoring.register_event_duration_secs_listener(listener)
            trajectories = engine.run(model[1], [0, 1], horizon, jax.random.key(horizon), policy_version=0)
            assert [t.status for t in trajectories] == [S.MAX_TURNS] * 4
            assert [t.num_turns for t in trajectories] == [horizon] * 4
        jax.monitoring.unregister_event_duration_listener(listener)
        assert "/jax/core/compile/backend_compile_duration" not in compilations
        with pytest.raises(ValueError, match="horizon"):
            engine.run(model[1], [0, 1], 0, jax.random.key(0), policy_version=0)


def test_slot_engine_reproduces_the_turn_batched_engine(framing, model, whole_batch_sampler, maze_url, task_info):
    """Continuous batching (2 tasks x 2 episodes over 2 sampler slots, decode in chunks of 3 steps,
    so slots are refilled mid-run and turns span chunks) gives token for token the trajectories of
    the turn-batched engine under the same key, sampling at temperature 1, and the same work per
    sampled token; the second run of the slot engine compiles nothing (a sampler whose shapes
    do not follow how many rows take part: which rows are filled together follows the order
    in which environments answer, and a new count of rows may be a new bucket)."""
    base = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, straggler_wait_s=0.0)
    slots = dataclasses.replace(base, num_slots=2, decode_chunk=3)
    runs, compilations = {}, []
    listener = lambda event, seconds, **kw: compilations.append(event)  # noqa: E731
    for name, config in (("turns", base), ("slots", slots)):
        whole_batch_sampler.work = SamplerWork()
        with RolloutEngine(whole_batch_sampler, framing, EnvPool(maze_url), task_info, config) as engine:
            for run in range(2 if name == "slots" else 1):
                if run == 1:
                    jax.monitoring.register_event_duration_secs_listener(listener)
                runs[name] = engine.run(model[1], [2, 5], 4, jax.random.key(3), policy_version=0)
            jax.monitoring.unregister_event_duration_listener(listener) if name == "slots" else None
            runs[name + "_stats"] = engine.last_stats
    assert "/jax/core/compile/backend_compile_duration" not in compilations
    assert [t.status for t in runs["slots"]] == [t.status for t in runs["turns"]]
    assert sum(t.num_turns for t in runs["slots"]) == runs["slots_stats"].turns >= 4
    for a, b in zip(runs["turns"], runs["slots"]):
        assert (a.task_id, a.group_id, a.sample_idx) == (b.task_id, b.group_id, b.sample_idx)
        assert a.token_ids == b.token_ids and a.turn_spans == b.turn_spans and a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.turn_rewards == b.turn_rewards
    slot_stats, turn_stats = runs["slots_stats"], runs["turns_stats"]
    assert slot_stats.prompt_tokens == turn_stats.prompt_tokens
    assert 0 < slot_stats.decode_live_steps == turn_stats.decode_live_steps


def test_a_bounded_pool_plays_in_waves_with_the_same_trajectories(framing, model, sampler, maze_url, task_info):
    """A pool that holds at most 3 live sessions plays 2 tasks x 2 episodes in waves (3, then 1:
    every episode of a wave is reset before any is stepped) and gives token for token the
    trajectories of an unbounded pool under the same key; it never holds more than 3 sessions,
    and a run closes its sessions at its end. Its progress counts finished episodes: 0 before the
    first sampler call, the first wave's 3 before the second starts, all 4 at the end; and the
    turns played and tokens decoded, its turns left falling to 0 (its share of the work to 1)."""
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, straggler_wait_s=0.0)
    runs, clients, heard = {}, {}, []
    for bound in (0, 3):
        pool, clients[bound] = counting_pool(maze_url, max_sessions=bound)
        with RolloutEngine(sampler, framing, pool, task_info, config) as engine:
            runs[bound] = engine.run(model[1], [2, 5], 4, jax.random.key(3), policy_version=0,
                                     on_progress=heard.append if bound else None)
            assert clients[bound][0].open_sessions == 0  # closed by the run, not only by the pool's close
            stats = engine.last_stats
    finished = [p.finished for p in heard]
    assert finished[0] == 0 and finished[-1] == 4 and 3 in finished and finished == sorted(finished)
    assert heard[0].turns == heard[0].tokens == 0 and heard[0].turns_left == 4 * 4 and heard[0].fraction == 0
    assert heard[-1].turns == stats.turns == sum(t.num_turns for t in runs[3])
    assert heard[-1].tokens == stats.decode_live_steps == sum(sum(t.loss_mask) for t in runs[3])
    assert heard[-1].turns_left == 0 and heard[-1].fraction == 1 and all(p.episodes == 4 for p in heard)
    fractions = [p.fraction for p in heard]
    assert fractions == sorted(fractions)
    assert clients[0][0].max_open_sessions == 4 and clients[3][0].max_open_sessions == 3
    assert clients[3][0].calls["/create"] == 3 and clients[3][0].calls["/reset"] == 4  # wave 2 reuses wave 1's
    for a, b in zip(runs[0], runs[3], strict=True):
        assert (a.task_id, a.group_id, a.sample_idx, a.status) == (b.task_id, b.group_id, b.sample_idx, b.status)
        assert a.token_ids == b.token_ids and a.turn_spans == b.turn_spans and a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.turn_rewards == b.turn_rewards


def test_a_group_member_admitted_later_copies_the_prompt(framing, model, sampler, maze_url, task_info):
    """One task x 3 episodes over 2 slots, turns forced to 1, 8 and 2 tokens: the third episode is
    admitted when the first ends, while the second still holds its row, and copies the prompt out
    of that row instead of prefilling it again (the slot engine prefills the prompt once, as the
    turn-batched engine does); every trajectory is the turn-batched engine's, token for token."""
    lengths = {0: 1, 1: MAX_NEW, 2: 2}
    base = RolloutConfig(group_size=3, max_tokens_per_turn=MAX_NEW, straggler_wait_s=0.0)
    runs = {}
    for name, config in (("turns", base), ("slots", dataclasses.replace(base, num_slots=2, decode_chunk=1))):
        sampler.work = SamplerWork()
        with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, config,
                           turn_lengths=lambda task, sample, turn: lengths[sample]) as engine:
            runs[name] = engine.run(model[1], [4], 3, jax.random.key(1), policy_version=0)
            runs[name + "_stats"] = engine.last_stats
    for a, b in zip(runs["turns"], runs["slots"]):
        assert a.status == b.status and a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert [t.num_turns for t in runs["slots"]] == [3, 3, 3]
    one_prefill = 256  # one row x the prompt's chunk bucket
    assert runs["turns_stats"].prompt_tokens_computed == one_prefill  # 1 row of the batch, the others copied
    assert runs["slots_stats"].prompt_tokens_computed == one_prefill  # 1 row, the others copied later


def test_shared_prompts_and_shrinking_batches_keep_the_trajectories(framing, model, sampler, whole_batch_sampler,
                                                                     maze_url, task_info):
    """2 tasks x 2 episodes at temperature 1, turns forced to 1 and 8 tokens (by sample) under a
    token budget (the long-turn episodes end first), turns in calls of 4 decode steps. The shared
    sampler, whose appends and decodes drop the rows that do not take part (into buckets of 1 and
    2 rows), plays the same trajectories token for token as one that runs all 4 rows of its batch
    every time, for less work: each task's prompt computed once (2 rows, not 4), fewer decode
    row-steps and appended tokens. Every sampled token's log-prob is what one forward pass over
    the whole trajectory gives (each row's cache, copied prompt included, holds its own tokens)."""
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, max_response_length=240, straggler_wait_s=None,
                           decode_chunk=4)
    lengths = {0: 1, 1: MAX_NEW}
    samplers = {
        "all rows": whole_batch_sampler,
        "rows taking part": sampler,
    }
    runs, stats = {}, {}
    for name, s in samplers.items():
        with RolloutEngine(s, framing, EnvPool(maze_url), task_info, config,
                           turn_lengths=lambda task, sample, turn: lengths[sample]) as engine:
            runs[name] = engine.run(model[1], [2, 5], 6, jax.random.key(4), policy_version=0)
            stats[name] = engine.last_stats
    assert len({t.num_turns for t in runs["all rows"]}) > 1  # episodes ended at different turns
    for a, b in zip(runs["all rows"], runs["rows taking part"], strict=True):
        assert a.status == b.status and a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    batch = make_token_batch(runs["rows taking part"])
    logits, _ = decoder.forward(model[1], batch.tokens, batch.positions, config=model[0])
    logits = np.asarray(logits, np.float64)
    eot = list(framing.end_of_turn_ids)
    logits[..., eot] = -np.inf  # masked before a forced turn's end, the only choice at it (log-prob 0)
    for row, t in enumerate(runs["rows taking part"]):
        for i in np.flatnonzero(t.loss_mask):
            token, z = t.token_ids[i], logits[row, i - 1]
            want = 0.0 if token in eot else z[token] - np.logaddexp.reduce(z)
            np.testing.assert_allclose(t.logprobs[i], want, atol=1e-5)
    plain, shrunk = stats["all rows"], stats["rows taking part"]
    assert shrunk.prompt_tokens_computed == 2 * 256 < plain.prompt_tokens_computed  # 2 prompts of ~200 ids, 256 bucket
    assert shrunk.decode_live_steps == plain.decode_live_steps == sum(sum(t.loss_mask) for t in runs["all rows"])
    assert shrunk.decode_row_steps < plain.decode_row_steps
    assert shrunk.observation_tokens_computed < plain.observation_tokens_computed


def test_token_budget(framing, model, sampler, maze_url, task_info):
    # 20 tokens: the first turn fits (<= 8 ids) but no observation (~60 ids) after it does.
    for budget in (5, 20):
        config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, max_response_length=budget)
        with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, config) as engine:
            trajectories = engine.run(model[1], [0, 1], 5, jax.random.key(2), policy_version=0)
        for t in trajectories:
            assert t.status == S.TOKEN_BUDGET and t.num_turns == 1
            prompt_len = t.turn_spans[0][0]
            assert len(t.token_ids) - prompt_len <= budget and t.turn_spans[-1][1] == len(t.token_ids)
            # A turn cut by the budget (5) is not sent; one that ended itself or was cut by the
            # per-turn limit is sent, and then its observation does not fit.
            ended_itself = t.token_ids[-1] in framing.end_of_turn_ids
            cut_by_budget = not ended_itself and budget < MAX_NEW
            assert len(t.turn_rewards) == (0 if cut_by_budget else 1)
            assert ended_itself or len(t.token_ids) - prompt_len == min(budget, MAX_NEW)


def test_invalid_action_limit(framing, model, sampler, maze_url, task_info):
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW, invalid_action_limit=2)
    with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, config) as engine:
        trajectories = engine.run(model[1], [0, 1], 6, jax.random.key(3), policy_version=0)
    for t in trajectories:  # a random model's text is never a maze move
        assert t.status == S.INVALID_ACTION_LIMIT and t.num_turns == 2 and t.invalid_actions == 2


class KillingPool(EnvPool):
    """Kills the server once every slot's first step has been answered."""

    def __init__(self, servers: LocalServers, num_slots: int, **kwargs):
        super().__init__(servers.urls["maze"], **kwargs)
        self.servers, self.num_slots, self.answered = servers, num_slots, 0

    async def step(self, slot, action):
        result = await super().step(slot, action)
        self.answered += 1
        if self.answered == self.num_slots:
            self.servers.servers[0].process.kill()
            self.servers.servers[0].process.wait()
        return result


def test_killed_server_ends_episodes_with_infra_error(framing, model, sampler, task_info):
    config = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW)
    with LocalServers(["maze"]) as servers:
        pool = KillingPool(servers, 4, max_retries=1, backoff_s=0.01)
        with RolloutEngine(sampler, framing, pool, task_info, config) as engine:
            trajectories = engine.run(model[1], [0, 1], 5, jax.random.key(4), policy_version=0)
    for t in trajectories:
        assert t.status == S.INFRA_ERROR and t.num_turns == 2  # the second step found no server
        assert sum(t.loss_mask) == sum(e - s for s, e in t.turn_spans) > 0


# ---- success and failure: a scripted policy ---------------------------------------------------


def oracle_moves(task_id: int, game: type = maze.MazeEnv) -> list[str]:
    """The maze (or room: `game`) oracle's moves for a task, played in-process (independent of the server)."""
    env = game()
    env.reset(task_id)
    moves = []
    while not env.verify():
        moves.append(env.oracle_action())
        env.step(moves[-1])
    return moves


@dataclasses.dataclass
class ScriptedState:
    live: np.ndarray
    num_rows: int
    cache: types.SimpleNamespace = dataclasses.field(  # no cache: its rows hold nothing
        default_factory=lambda: types.SimpleNamespace(index=np.zeros(64, np.int32))
    )

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


class ScriptedSampler:
    """Emits `Action: <move>` (or `action_format`) as token ids (content + end-of-turn), row by row."""

    def __init__(self, framing: ChatFraming, scripts: list[list[str]], action_format: str = "Action: {}"):
        self.framing, self.scripts, self.action_format = framing, scripts, action_format
        self.config = SamplingConfig(max_new_tokens=16, eot_ids=framing.end_of_turn_ids, return_raw_logprobs=True)
        self.work = SamplerWork()
        self.turn = [0] * len(scripts)

    def sampling_params(self, params):
        return params

    def prefill(self, params, prompts):
        return ScriptedState(np.ones(len(prompts), bool), len(prompts))

    def append(self, params, state, chunks, live=None):
        return state, np.zeros(state.num_rows, bool)

    def generate(self, params, state, rng, limit=None, **kw):
        rows, width = state.num_rows, self.config.max_new_tokens
        tokens, count = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
        stop = np.full(rows, StopReason.NOT_LIVE, np.int32)
        for row in np.flatnonzero(state.live):
            move = self.scripts[row][self.turn[row] % len(self.scripts[row])]
            ids = self.framing.assistant_ids(self.action_format.format(move)).ids
            tokens[row, : len(ids)], count[row], stop[row] = ids, len(ids), StopReason.END_OF_TURN
            self.turn[row] += 1
        logprobs = np.where(np.arange(width) < count[:, None], -0.5, 0.0).astype(np.float32)
        return state, TurnOutput(tokens, count, logprobs, logprobs, stop)


def test_success_and_failure_with_a_scripted_policy(framing, maze_url, task_info):
    solve = oracle_moves(12)
    shuffle = ["move left", "move right"]  # stays within two squares; every goal is >= 4 moves away
    scripted = ScriptedSampler(framing, [solve, solve, shuffle, shuffle])
    config = RolloutConfig(group_size=2, max_tokens_per_turn=16, max_response_length=100_000)
    with RolloutEngine(scripted, framing, EnvPool(maze_url), task_info, config) as engine:
        trajectories = engine.run(None, [12, 40], 100, jax.random.key(5), policy_version=0)
    batch = make_token_batch(trajectories)
    for row, t in enumerate(trajectories[:2]):
        assert t.status == S.SUCCESS and t.num_turns == len(solve) and t.reward == 1.0
        assert t.turn_rewards == [0.0] * (len(solve) - 1) + [1.0]
        assert float(batch.token_rewards[row].sum()) == 1.0
        assert float(batch.token_rewards[row, t.turn_spans[-1][1] - 1]) == 1.0
    for t in trajectories[2:]:
        assert t.status == S.FAILURE and t.num_turns == maze.MAX_STEPS and t.reward == 0.0


class SlowSlotPool(EnvPool):
    """A real pool whose slot 0 answers each step `delay_s` late (a slow environment)."""

    delay_s = 0.5

    async def step(self, slot, action):
        if slot == 0:
            await asyncio.sleep(self.delay_s)
        return await super().step(slot, action)


class CallRecordingSampler(ScriptedSampler):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[tuple[int, ...]] = []  # the rows of each generate call

    def generate(self, params, state, rng, limit=None, **kw):
        self.calls.append(tuple(int(row) for row in np.flatnonzero(state.live)))
        return super().generate(params, state, rng, limit)


@pytest.mark.parametrize("straggler_wait_s", [0.02, None])
def test_fast_episodes_do_not_wait_for_a_slow_one(framing, maze_url, task_info, straggler_wait_s):
    scripted = CallRecordingSampler(framing, [["move left", "move right"]] * 4)
    config = RolloutConfig(group_size=2, max_tokens_per_turn=16, straggler_wait_s=straggler_wait_s)
    with RolloutEngine(scripted, framing, SlowSlotPool(maze_url), task_info, config) as engine:
        trajectories = engine.run(None, [40, 41], 4, jax.random.key(6), policy_version=0)
    stats = engine.last_stats
    assert [t.status for t in trajectories] == [S.MAX_TURNS] * 4
    if straggler_wait_s is None:  # lock-step: every call waits for the slow slot
        assert scripted.calls == [(0, 1, 2, 3)] * 4
        assert stats.sampler_wait_s >= 3 * SlowSlotPool.delay_s
    else:  # rows 1-3 play their 4 turns while slot 0 waits on its first step
        back = next(i for i, rows in enumerate(scripted.calls) if i and 0 in rows)
        assert scripted.calls[0] == (0, 1, 2, 3) and scripted.calls[back:] == [(0,)] * 3
        others = collections.Counter(row for rows in scripted.calls[1:back] for row in rows)
        assert others == {1: 3, 2: 3, 3: 3}
        assert max(trajectories[k].timings["env_s"] for k in (1, 2, 3)) < SlowSlotPool.delay_s


def test_env_timeout_passes_through(framing, task_info):
    # FaultyMazeEnv takes a second over the raw action "sleep"; the pool waits 0.3 s per request.
    scripted = ScriptedSampler(framing, [["move left", "sleep"]], action_format="{}")
    config = RolloutConfig(max_tokens_per_turn=16)
    with start_server("tests.server_test_envs:FaultyMazeEnv") as url:
        with RolloutEngine(scripted, framing, EnvPool(url, request_timeout_s=0.3), task_info, config) as engine:
            [t] = engine.run(None, [40], 10, jax.random.key(7), policy_version=0)
    assert t.status == S.ENV_TIMEOUT and t.num_turns == 2 and t.turn_rewards == [0.0, 0.0]
    assert t.turn_spans[-1][1] == len(t.token_ids)


# ---- demonstrations ---------------------------------------------------------------------------


def oracle_demonstrations(url, framing, task_ids, prompt_style="short", **play_kwargs):
    """The oracle's episodes of `task_ids` on the server at `url`, as demonstration trajectories."""
    async def play():
        async with EnvPool(url) as pool:
            episodes = await demonstrations.play_oracle_episodes(pool, task_ids, **play_kwargs)
            info = await pool.tasks()
        return [demonstrations.demonstration_trajectory(framing, info, ep, group_id=i, prompt_style=prompt_style)
                for i, ep in enumerate(episodes)]

    return run_sync(play())


@pytest.mark.parametrize("action_format", [demonstrations.ACTION_ONLY, demonstrations.THOUGHT_ACTION])
def test_oracle_demonstrations_are_token_exact(framing, maze_url, task_info, action_format):
    tokenizer = framing.tokenizer
    task_ids = [12, 40, 260]
    demos = oracle_demonstrations(maze_url, framing, task_ids, action_format=action_format)
    for task_id, t in zip(task_ids, demos):
        moves = oracle_moves(task_id)
        assert t.status == S.SUCCESS and t.reward == 1.0 and t.num_turns == len(moves)
        # The framed transcript, rendered by the chat template itself from the replayed episode.
        env = maze.MazeEnv()
        messages = [{"role": "user", "content": f"{task_info.instruction}\n\n{env.reset(task_id)}"}]
        for k, move in enumerate(moves):
            if k:
                messages.append({"role": "user", "content": env.observation()})
            messages.append({"role": "assistant", "content": action_format.format(action=move)})
            env.step(move)
        reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        after = list(framing.after_end_of_turn_ids)  # the template's "\n" after the last turn
        assert t.token_ids + after == list(reference)
        assert t.text == tokenizer.decode(t.token_ids)
        assert t.experts == []  # kept only with `record_experts`
        # loss_mask: 1 exactly on each assistant content + end-of-turn; log-probs all 0.
        spans = [tokenizer.decode(t.token_ids[s:e]) for s, e in t.turn_spans]
        assert spans == [action_format.format(action=m) + "<|im_end|>" for m in moves]
        assert sum(t.loss_mask) == sum(e - s for s, e in t.turn_spans)
        assert all(t.loss_mask[i] for s, e in t.turn_spans for i in range(s, e))
        assert not any(t.logprobs)


def test_agentgym_prompt_style_masks_the_acknowledgement(framing, maze_url, task_info):
    [t] = oracle_demonstrations(maze_url, framing, [12], prompt_style="agentgym", horizon=2)
    assert t.status == S.MAX_TURNS and t.num_turns == 2
    prompt = framing.tokenizer.decode(t.token_ids[: t.turn_spans[0][0]])
    acknowledged = "<|im_start|>assistant\nOk.<|im_end|>"
    assert prompt.startswith(f"<|im_start|>user\n{task_info.instruction}<|im_end|>\n{acknowledged}")
    assert not any(t.loss_mask[: t.turn_spans[0][0]])


# ---- bad input --------------------------------------------------------------------------------


def test_bad_config_and_sampler_are_refused(framing, sampler, task_info):
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(ValueError, match="invalid_action_limit"):
        RolloutConfig(invalid_action_limit=-1)
    with pytest.raises(ValueError, match="'chat'"):
        RolloutConfig(prompt_style="chat")
    pool = EnvPool("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="end-of-turn"):
        bad = Sampler(lambda *a: None, lambda *a: None, SamplingConfig(max_new_tokens=8), max_cache_len=128)
        RolloutEngine(bad, framing, pool, task_info, RolloutConfig(max_tokens_per_turn=8))
    with pytest.raises(ValueError, match="max_new_tokens"):
        RolloutEngine(sampler, framing, pool, task_info, RolloutConfig(max_tokens_per_turn=MAX_NEW + 1))
    with pytest.raises(ValueError, match="record_experts needs a sampler that returns the experts"):
        RolloutEngine(sampler, framing, pool, task_info, RolloutConfig(max_tokens_per_turn=MAX_NEW, record_experts=True))
    with pytest.raises(ValueError, match="action_format"):
        run_sync(demonstrations.play_oracle_episodes(EnvPool("http://127.0.0.1:1"), [0], action_format="Action:"))


def test_a_dense_policy_refuses_to_record_experts(framing, model, sampler, maze_url, task_info):
    """Refused where the sampler is built; a sampler whose step returns no experts though its
    config asks for them (the shared one, relabelled) is refused at its first turn."""
    config = RolloutConfig(max_tokens_per_turn=MAX_NEW, record_experts=True)
    with pytest.raises(ValueError, match="return_experts needs a mixture of experts; qwen2 routes no experts"):
        Sampler.for_decoder(model[0], config.sampling_config(framing), max_cache_len=256)
    recorder = RecordingSampler(sampler)
    recorder.config = dataclasses.replace(sampler.config, return_experts=True)
    with RolloutEngine(recorder, framing, EnvPool(maze_url), task_info, config) as engine:
        with pytest.raises(ValueError, match="rollout.record_experts needs a mixture-of-experts policy"):
            engine.run(model[1], [0], 1, jax.random.key(0), policy_version=0)


def test_padding_stays_inside_the_vocabulary(framing, model):
    """A tokenizer's pad id can lie past the embedding table (transformers 5 appends one to
    tokenizers that have none); fed to the model for dead or finished rows it would embed as NaN."""
    tokenizer = types.SimpleNamespace(pad_token_id=model[0].vocab_size + 5)
    odd = types.SimpleNamespace(tokenizer=tokenizer, end_of_turn_ids=framing.end_of_turn_ids)
    assert RolloutConfig().sampling_config(odd).pad_id == 0


class ParamsRecordingSampler(RecordingSampler):
    """The real sampler, plus how often the engine made its copy of the params and what each call read."""

    def __init__(self, sampler: Sampler):
        super().__init__(sampler)
        self.copies, self.read = 0, []

    def sampling_params(self, params):
        self.copies += 1
        return super().sampling_params(params)

    def prefill(self, params, prompts):
        self.read.append(params)
        return super().prefill(params, prompts)

    def append(self, params, state, chunks, live=None):
        self.read.append(params)
        return super().append(params, state, chunks, live)

    def generate(self, params, state, rng, limit=None, **kw):
        self.read.append(params)
        return super().generate(params, state, rng, limit, **kw)


def test_a_bf16_sampler_copies_the_weights_once_per_run(framing, model, maze_url, task_info):
    """Compute in bfloat16 over float32 weights: one bf16 copy per `run`, read by every turn of it."""
    config, params = model
    sampling = RolloutConfig(max_tokens_per_turn=MAX_NEW).sampling_config(framing)
    bf16 = Sampler.for_decoder(
        config, sampling, max_cache_len=2048, dtype=jnp.bfloat16,
        batch_buckets=(4,), chunk_buckets=(128, 256), cache_buckets=(2048,),
    )
    recording = ParamsRecordingSampler(bf16)
    rollout = RolloutConfig(group_size=2, max_tokens_per_turn=MAX_NEW)
    with RolloutEngine(recording, framing, EnvPool(maze_url), task_info, rollout) as engine:
        for run in range(2):
            recording.read = []
            trajectories = engine.run(params, [0, 1], 3, jax.random.key(run), policy_version=run)
            assert [t.num_turns for t in trajectories] == [3] * 4
            assert recording.copies == run + 1
            assert len(recording.read) == 1 + 3 + 2  # prefill, 3 turns, 2 appends between them
            assert all(p is recording.read[0] for p in recording.read)
            assert {leaf.dtype for leaf in jax.tree.leaves(recording.read[0])} == {jnp.dtype(jnp.bfloat16)}
