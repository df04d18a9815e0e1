"""The multi-turn rollout engine: a batch of tasks x `group_size` episodes, token in, token out.

    engine = RolloutEngine(sampler, framing, EnvPool(urls), task_info, RolloutConfig(group_size=4))
    trajectories = engine.run(params, task_ids, horizon=10, rng=key, policy_version=step)
    engine.last_stats.wait_fraction      # share of wall time the sampler waited on environments

One episode: reset -> first prompt (`transcript.Transcript.start`) -> loop while turns < horizon:
the sampler continues the episode's KV cache with the new environment ids and samples a turn;
the decoded text is sent as the action (the server parses it; `info.invalid_action` says whether
it could); the observation's exact continuation ids become the next chunk to append. The
training sequence is the prompt, the sampled ids and the appended ids, nothing re-tokenized.

How episodes end (one `EpisodeStatus` each):
- success / failure: the environment said `done` (with / without `info.success`);
- max_turns: `horizon` policy turns were played;
- token_budget: the episode's response (policy + environment ids after the prompt) reached
  `max_response_length`, or the sampler's cache (`max_cache_len`) filled up;
- invalid_action_limit: `invalid_action_limit` consecutive invalid actions;
- env_timeout / infra_error: passed through from the `EnvPool`.
The final observation is never appended (nothing after the last policy token is trained on);
a turn cut by `max_tokens_per_turn` is still sent as an action (and closed with the end-of-turn
ids, loss_mask 0, before the observation). The reward of an episode is the sum of the
environment's step rewards (`turn_rewards`); `rollout/batch.py` puts it on the last policy token.

Overlap: environment steps run concurrently on the event loop while the sampler's jitted calls
run in a worker thread. The sampler takes every episode whose observation has arrived; once one
has arrived it waits at most `straggler_wait_s` for the others, so fast episodes go on without
the slowest. Every sampler call writes cache columns for all rows (padding for rows not in it),
so splitting a batch costs cache space: size `max_cache_len` for the number of calls, not turns.
Each call samples with `fold_in(rng, call index)`, so a run is reproducible from `rng` when the
calls are (lock-step, `straggler_wait_s=None`, or greedy sampling).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from agentgym_jax.aio import LoopThread
from agentgym_jax.envs.pool import EnvPool, SlotResult
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.transcript import PromptStyle, Transcript, empty_trajectory
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler, SamplerState, StopReason, TurnOutput

Params = Any


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How episodes are played. Token limits follow AgentGym-RL's `max_tokens` (per turn) and
    `max_response_length` (per episode, policy + environment tokens after the prompt)."""

    group_size: int = 1  # samples per task; they share a group id (GRPO/RLOO groups)
    max_tokens_per_turn: int = 256
    max_response_length: int = 4096
    invalid_action_limit: int | None = None  # consecutive invalid actions that end an episode; 0/None: off
    temperature: float = 1.0  # sampling settings, see `sampling_config`
    top_k: int = 0
    top_p: float = 1.0
    prompt_style: PromptStyle = PromptStyle.SHORT
    straggler_wait_s: float | None = 0.05  # None: every sampler call waits for all observations

    def __post_init__(self):
        object.__setattr__(self, "prompt_style", PromptStyle(self.prompt_style))
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.max_tokens_per_turn < 1 or self.max_response_length < 1:
            raise ValueError(
                f"max_tokens_per_turn ({self.max_tokens_per_turn}) and max_response_length "
                f"({self.max_response_length}) must be >= 1"
            )
        if self.invalid_action_limit is not None and self.invalid_action_limit < 0:
            raise ValueError(f"invalid_action_limit must be >= 0 (0/None: off), got {self.invalid_action_limit}")
        if self.straggler_wait_s is not None and self.straggler_wait_s < 0:
            raise ValueError(f"straggler_wait_s must be >= 0 or None, got {self.straggler_wait_s}")

    def sampling_config(self, framing: ChatFraming, **overrides: Any) -> SamplingConfig:
        """The sampler settings this rollout needs: stop on the framing's end-of-turn id.

        Padding (dead rows, finished rows' inputs) uses id 0, not the tokenizer's pad id: that id
        may lie outside the model's embedding table (transformers 5 adds one to tokenizers without
        a pad token), and its NaN embedding would reach the row's cache. Padding is masked anyway.
        """
        return SamplingConfig(
            **{
                "max_new_tokens": self.max_tokens_per_turn,
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "eot_ids": framing.end_of_turn_ids,
                "return_raw_logprobs": True,  # what trajectories store: see `_sample_turn`
                **overrides,
            }
        )


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Where the wall time of one `run` went (for "rollout vs update time" and the benchmark)."""

    wall_s: float
    sampler_busy_s: float  # inside prefill / append / generate
    sampler_wait_s: float  # the sampler idle while episodes waited on the environments
    sampler_calls: int  # append+generate calls after the prefill
    turns: int  # policy turns sampled, all episodes together

    @property
    def wait_fraction(self) -> float:
        return self.sampler_wait_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclasses.dataclass
class _Episode:
    slot: int  # also the sampler row
    task_id: int
    group_id: int
    sample_idx: int
    transcript: Transcript | None = None  # None until reset succeeded
    pending: tuple[int, ...] = ()  # observation ids to append before the next turn
    status: EpisodeStatus | None = None
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    invalid_actions: int = 0
    invalid_in_a_row: int = 0
    sample_s: float = 0.0
    env_s: float = 0.0


class RolloutEngine:
    """Plays batches of episodes with one sampler over one `EnvPool`. See the module docstring.

    `run` is synchronous, also in a notebook cell: it drives the pool on the engine's own event
    loop (on a thread of its own) and opens the pool there on first use (pass an unopened
    `EnvPool`; `close()` closes it). Code that already runs an event loop with an open pool awaits
    `run_async` instead. Slots are reused by the next call
    (their sessions are reset, not reopened). `task_info=None` asks the pool's server for it.
    """

    def __init__(
        self,
        sampler: Sampler,
        framing: ChatFraming,
        pool: EnvPool,
        task_info: TaskInfo | None,
        config: RolloutConfig,
    ):
        eot = set(framing.end_of_turn_ids)
        if not eot <= set(sampler.config.eot_ids):
            raise ValueError(
                f"the sampler must stop on the framing's end-of-turn ids {sorted(eot)}, "
                f"it stops on {list(sampler.config.eot_ids)}; build it with config.sampling_config(framing)"
            )
        if not sampler.config.return_raw_logprobs:
            raise ValueError("the sampler must return raw log-probs (what trajectories store); "
                             "build it with config.sampling_config(framing)")
        if config.max_tokens_per_turn > sampler.config.max_new_tokens:
            raise ValueError(
                f"max_tokens_per_turn={config.max_tokens_per_turn} exceeds the sampler's "
                f"max_new_tokens={sampler.config.max_new_tokens}"
            )
        self.sampler = sampler
        self.framing = framing
        self.pool = pool
        self.task_info = task_info
        self.config = config
        self.last_stats: RolloutStats | None = None
        self._loop: LoopThread | None = None
        self._pool_opened = False

    def run(
        self,
        params: Params,
        task_ids: Sequence[int],
        horizon: int,
        rng: jax.Array,
        *,
        policy_version: int,
        group_offset: int = 0,
    ) -> list[Trajectory]:
        """Plays `task_ids` x `group_size` episodes of at most `horizon` turns each.

        Returns one trajectory per slot, in slot order (task-major): group id
        `group_offset + task index`, `sample_idx` the index within the group.
        """
        if self._loop is None:
            self._loop = LoopThread("rollout-engine")
        if not self._pool_opened:
            self._loop.run(self.pool.__aenter__())
            self._pool_opened = True
        return self._loop.run(
            self.run_async(params, task_ids, horizon, rng, policy_version=policy_version, group_offset=group_offset)
        )

    async def run_async(
        self,
        params: Params,
        task_ids: Sequence[int],
        horizon: int,
        rng: jax.Array,
        *,
        policy_version: int,
        group_offset: int = 0,
    ) -> list[Trajectory]:
        """`run` for callers inside an event loop, with the pool already open in it."""
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 turn, got {horizon}")
        if len(task_ids) == 0:
            raise ValueError("run needs at least one task id")
        if self.task_info is None:
            self.task_info = await self.pool.tasks()
        # The sampler's copy of the params (bf16 under bf16 compute), made once for the whole run.
        rollout = _Rollout(self, self.sampler.sampling_params(params), rng, horizon)
        n = self.config.group_size
        episodes = [
            _Episode(slot=i * n + j, task_id=int(task), group_id=group_offset + i, sample_idx=j)
            for i, task in enumerate(task_ids)
            for j in range(n)
        ]
        await rollout.play(episodes)
        self.last_stats = rollout.stats()
        return [self._trajectory(ep, policy_version) for ep in episodes]

    def close(self) -> None:
        """Closes the pool (if `run` opened it) and the engine's event loop."""
        if self._loop is None:
            return
        if self._pool_opened:
            self._loop.run(self.pool.close())
            self._pool_opened = False
        self._loop.close()  # also joins the sampler's worker thread
        self._loop = None

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _trajectory(self, ep: _Episode, policy_version: int) -> Trajectory:
        fields = dict(
            invalid_actions=ep.invalid_actions,
            sample_idx=ep.sample_idx,
            policy_version=policy_version,
            timings={"sample_s": ep.sample_s, "env_s": ep.env_s},
        )
        env = self.task_info.env
        if ep.transcript is None:
            return empty_trajectory(ep.task_id, env, ep.group_id, ep.status, **fields)
        return ep.transcript.to_trajectory(
            task_id=ep.task_id, env=env, group_id=ep.group_id, turn_rewards=ep.turn_rewards,
            status=ep.status, **fields,
        )


class _Rollout:
    """The state of one `run`: episodes, the sampler state, and the sampler/environment overlap."""

    def __init__(self, engine: RolloutEngine, params: Params, rng: jax.Array, horizon: int):
        self.engine = engine
        self.sampler = engine.sampler
        self.config = engine.config
        self.params = params
        self.rng = rng
        self.horizon = horizon
        self.episodes: list[_Episode] = []
        self.state: SamplerState | None = None
        self.ready: set[int] = set()  # rows whose next turn can be sampled
        self.in_flight = 0  # environment steps outstanding
        self.arrived = asyncio.Event()
        self.failure: Exception | None = None
        self.steps: set[asyncio.Task] = set()
        self.start = time.monotonic()
        self.busy_s = self.wait_s = 0.0
        self.calls = self.turns = 0

    def stats(self) -> RolloutStats:
        return RolloutStats(time.monotonic() - self.start, self.busy_s, self.wait_s, self.calls, self.turns)

    async def play(self, episodes: list[_Episode]) -> None:
        self.episodes = episodes
        try:
            await self._reset_and_prefill()
            while self.ready or self.in_flight:
                await self._wait_for_observations()
                rows = sorted(self.ready)
                self.ready.clear()
                if rows:  # empty when the last observations all ended their episodes
                    await self._sample_turn(rows)
                if self.failure is not None:
                    raise self.failure
        finally:
            for task in self.steps:  # only left over when something raised
                task.cancel()

    async def _reset_and_prefill(self) -> None:
        start = time.monotonic()
        pool = self.engine.pool
        results = await asyncio.gather(*(self._timed(ep, pool.reset(ep.slot, ep.task_id)) for ep in self.episodes))
        self.wait_s += time.monotonic() - start
        info, style = self.engine.task_info, self.config.prompt_style
        for ep, result in zip(self.episodes, results):
            if result.status is not None:
                ep.status = result.status
            else:
                ep.transcript = Transcript.start(self.engine.framing, info.instruction, result.observation, style)
                self.ready.add(ep.slot)
        if not self.ready:
            return
        pad = [self.sampler.config.pad_id]
        prompts = [ep.transcript.token_ids if ep.transcript else pad for ep in self.episodes]
        self.state = await self._in_sampler(lambda: self.sampler.prefill(self.params, prompts), sorted(self.ready))

    async def _timed(self, ep: _Episode, request) -> SlotResult:
        start = time.monotonic()
        try:
            return await request
        finally:
            ep.env_s += time.monotonic() - start

    async def _in_sampler(self, call, rows: Sequence[int]):
        """Runs a sampler call in a worker thread (the event loop keeps serving environments)."""
        start = time.monotonic()
        out = await asyncio.to_thread(call)
        elapsed = time.monotonic() - start
        self.busy_s += elapsed
        for row in rows:
            self.episodes[row].sample_s += elapsed
        return out

    async def _wait_for_observations(self) -> None:
        """Waits until some episode is ready, then up to `straggler_wait_s` for the others."""
        start = time.monotonic()
        wait = self.config.straggler_wait_s
        while self.in_flight and (not self.ready or wait is None):
            await self._next_arrival(None)
        deadline = time.monotonic() + (wait or 0.0)
        while self.in_flight and wait and (remaining := deadline - time.monotonic()) > 0:
            await self._next_arrival(remaining)
        self.wait_s += time.monotonic() - start

    async def _next_arrival(self, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(self.arrived.wait(), timeout)
        except asyncio.TimeoutError:
            return
        self.arrived.clear()
        if self.failure is not None:
            raise self.failure

    async def _sample_turn(self, rows: list[int]) -> None:
        """Appends the rows' pending observation ids, samples their turn and sends the actions."""
        num_rows = len(self.episodes)
        in_call = np.zeros((num_rows,), bool)
        in_call[rows] = True
        chunks = [ep.pending if in_call[ep.slot] else () for ep in self.episodes]
        budget = self.config.max_response_length
        limits = [
            min(self.config.max_tokens_per_turn, budget - ep.transcript.response_len - len(ep.pending))
            if in_call[ep.slot] else 0
            for ep in self.episodes
        ]  # fmt: skip
        rng = jax.random.fold_in(self.rng, self.calls)
        self.calls += 1
        overflow, turn = await self._in_sampler(lambda: self._append_and_generate(in_call, chunks, limits, rng), rows)
        for row in rows:
            ep = self.episodes[row]
            count = 0 if overflow[row] else int(turn.count[row])
            if count == 0:  # no room left in the cache: the pending observation is not kept
                ep.status = EpisodeStatus.TOKEN_BUDGET
                continue
            self.turns += 1
            if ep.pending:
                ep.transcript.add_observation(ids=ep.pending)
                ep.pending = ()
            ids = turn.tokens[row, :count]
            # Unfiltered log-probs at the sampling temperature: the policy the trainer recomputes.
            ep.transcript.add_policy_turn(ids, turn.raw_logprobs[row, :count])
            stop = StopReason(int(turn.stop[row]))
            if stop is StopReason.CACHE_FULL or (
                stop is StopReason.TOKEN_LIMIT and ep.transcript.response_len >= budget
            ):
                ep.status = EpisodeStatus.TOKEN_BUDGET
                continue
            text = self.engine.framing.tokenizer.decode(ids, skip_special_tokens=True)
            self.in_flight += 1
            task = asyncio.create_task(self._step(ep, text))
            self.steps.add(task)
            task.add_done_callback(self.steps.discard)

    def _append_and_generate(
        self, in_call: np.ndarray, chunks: list[tuple[int, ...]], limits: list[int], rng: jax.Array
    ) -> tuple[np.ndarray, TurnOutput | None]:
        """(worker thread) -> (overflow [rows] bool, the turn or None if every row overflowed)."""
        live = np.zeros(self.state.live.shape, bool)
        live[: len(in_call)] = in_call
        state = self.state.replace(live=live)  # only this call's rows take part
        overflow = np.zeros(in_call.shape, bool)
        if any(chunks):
            state, overflow = self.sampler.append(self.params, state, chunks)
        turn = None
        if not overflow.any():  # the chunk bucket is shared: all rows fit or none does
            state, turn = self.sampler.generate(self.params, state, rng, limit=limits)
        self.state = state
        return overflow, turn

    async def _step(self, ep: _Episode, action: str) -> None:
        """Sends one action; ends the episode or queues its observation ids for the next turn."""
        try:
            result = await self._timed(ep, self.engine.pool.step(ep.slot, action))
            self._after_step(ep, result)
        except Exception as e:  # surfaced by the sampler loop, not lost in a task
            self.failure = e
        finally:
            self.in_flight -= 1
            self.arrived.set()

    def _after_step(self, ep: _Episode, result: SlotResult) -> None:
        ep.turn_rewards.append(result.reward)
        invalid = bool(result.info.get("invalid_action"))
        ep.invalid_actions += invalid
        ep.invalid_in_a_row = ep.invalid_in_a_row + 1 if invalid else 0
        limit = self.config.invalid_action_limit
        if result.status is not None:
            ep.status = result.status
        elif limit and ep.invalid_in_a_row >= limit:
            ep.status = EpisodeStatus.INVALID_ACTION_LIMIT
        elif ep.transcript.num_turns >= self.horizon:
            ep.status = EpisodeStatus.MAX_TURNS
        else:
            ids = ep.transcript.observation_ids(result.observation)
            if ep.transcript.response_len + len(ids) >= self.config.max_response_length:
                ep.status = EpisodeStatus.TOKEN_BUDGET  # no room to sample after the observation
            else:
                ep.pending = ids
                self.ready.add(ep.slot)
