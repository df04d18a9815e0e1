"""The multi-turn rollout engine: a batch of tasks x `group_size` episodes, token in, token out.

    engine = RolloutEngine(sampler, framing, EnvPool(urls), task_info, RolloutConfig(group_size=4))
    trajectories = engine.run(params, task_ids, horizon=10, rng=key, policy_version=step)
    engine.last_stats.wait_fraction      # share of wall time the sampler waited on environments

One episode: reset -> first prompt (`transcript.Transcript.start`) -> loop while turns < horizon:
the sampler continues the episode's KV cache with the new environment ids and samples a turn;
the decoded text is sent as the action (the server parses it; `info.invalid_action` says whether
it could); the observation's exact continuation ids become the next chunk to append. With
`tool_calls` (function calling, `rollout/tool_use.py`) the prompt carries the session's tools,
a reply is sent as the tool call it holds and the answer is appended as a tool message. The
training sequence is the prompt, the sampled ids and the appended ids, nothing re-tokenized.

How episodes end (one `EpisodeStatus` each):
- success / failure: the environment said `done` (with / without `info.success`);
- max_turns: `horizon` policy turns were played;
- token_budget: the episode's response (policy + environment ids after the prompt) reached
  `max_response_length`, or the sampler's cache (`max_cache_len`) filled up;
- invalid_action_limit: `invalid_action_limit` consecutive invalid actions;
- env_timeout / infra_error: passed through from the `EnvPool`.
A replayed prefix (`run(replay=...)`: per task, actions an oracle took) is played right after
the reset: each action is sent as a step of the real session and its text and the environment's
answer join the prompt (`Transcript.add_replayed_turn`, loss_mask 0, no log-probs, no turn span),
so the policy starts k turns into the task and its own turns, the horizon, invalid actions, the
token budget and the reward count from there. The group's samples replay the same actions into
the same state, so their prompts stay identical (one prefill, one shared prefix in training). A
replayed step that ends the episode (an environment that did not repeat the demonstration, or a
replay as long as it) ends it `infra_error`, unscored, with no policy turn.
The final observation is never appended (nothing after the last policy token is trained on);
a turn cut by `max_tokens_per_turn` is still sent as an action (and closed with the end-of-turn
ids, loss_mask 0, before the observation). The reward of an episode is the sum of the
environment's step rewards (`turn_rewards`); `rollout/batch.py` puts it on the last policy token.

Overlap: environment steps run concurrently on the event loop while the sampler's jitted calls
run in a worker thread. The sampler takes every episode whose observation has arrived; once one
has arrived it waits at most `straggler_wait_s` for the others, so fast episodes go on without
the slowest. Every row of the sampler's cache holds its own episode's tokens only (per-row write pointers),
so splitting a batch over calls costs no cache space. An episode's n-th token of turn t is drawn
with a key folded from (`rng`, episode number, t, n), whatever call or batch it is sampled in, so a
run is reproducible from `rng` and the slot engine (`num_slots`, `_SlotRollout` below) gives the
same trajectories as this turn-batched engine (up to float rounding in batches of other shapes).

Sessions: every episode of a batch is reset before any is stepped, so a run plays its episodes in
waves of at most `pool.session_capacity()` (a pool bounded by `max_sessions` or by its servers'
caps, e.g. one browser per session; one wave otherwise), with the same trajectories, and closes
its sessions at its end.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from agentgym_jax.aio import LoopThread
from agentgym_jax.envs.pool import EnvPool, SlotResult
from agentgym_jax.envs.protocol import EpisodeStatus, TaskInfo
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.rollout import tool_use
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout.transcript import PromptStyle, Transcript, empty_trajectory
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler, SamplerState, StopReason, Turn, TurnOutput

Params = Any
T = TypeVar("T")


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
    num_slots: int = 0  # > 0: continuous batching over this many sampler rows (`_SlotRollout`); 0: turn-batched
    # decode steps per sampler call; between calls the batch drops the rows whose turn ended (turn-batched)
    # or admits episodes and appends arrived observations (slots)
    decode_chunk: int = 16
    fill_tokens: int = 8192  # tokens one sampler fill or append computes at most: bounds its memory
    tool_calls: bool = False  # function calling: tools in the prompt, replies read as calls, results as tool messages
    # A mixture of experts: keep each policy token's experts (layers x k ids) in its trajectory
    # (`Trajectory.experts`), for the trainer's `routing_mismatch`; off: they are large at real sizes.
    record_experts: bool = False

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
        if self.num_slots < 0 or self.decode_chunk < 1:
            raise ValueError(
                f"num_slots must be >= 0 (0: turn-batched) and decode_chunk >= 1, got num_slots="
                f"{self.num_slots}, decode_chunk={self.decode_chunk}"
            )
        if self.fill_tokens < 1:
            raise ValueError(f"fill_tokens must be >= 1, got {self.fill_tokens}")

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
                "return_experts": self.record_experts,
                **overrides,
            }
        )


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Where the wall time of one `run` went (for "rollout vs update time" and the benchmark)."""

    wall_s: float
    sampler_busy_s: float  # inside prefill / append / generate
    sampler_wait_s: float  # the sampler idle while episodes waited on the environments
    sampler_calls: int  # append+generate calls after the prefill (slots: decode chunks)
    turns: int  # policy turns sampled, all episodes together
    decode_row_steps: int = 0  # rows x steps the decode loops computed (the batch bucket's rows)
    decode_live_steps: int = 0  # of those, row-steps that sampled a token
    prompt_tokens_computed: int = 0  # rows x chunk width the prompt prefills ran (padding included)
    observation_tokens_computed: int = 0  # rows x chunk width the appends after the prompts ran (padding included)
    prompt_tokens: int = 0  # real prompt tokens of all episodes
    cache_slots: int = 0  # KV cache slots the episodes' rows spanned when they ended, all together

    @property
    def useful_fraction(self) -> float:
        """Decode row-steps that sampled a token / row-steps computed."""
        return self.decode_live_steps / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def wait_fraction(self) -> float:
        return self.sampler_wait_s / self.wall_s if self.wall_s > 0 else 0.0


class RolloutProgress(NamedTuple):
    """How far a `run` has got, what its `on_progress` hears: episodes ended of `episodes`,
    policy turns sampled and tokens decoded so far, and at most how many turns are left (the
    unfinished episodes' turns up to their horizon)."""

    finished: int
    episodes: int
    turns: int
    tokens: int
    turns_left: int | None  # None: not known (an agent program plays as many as it likes)

    @property
    def fraction(self) -> float:
        """The share of the run's turns played, counting those the ended episodes no longer need:
        how far a batch is while its episodes all finish near its end. Without the turns left (an
        agent program's episodes), the share of episodes ended."""
        if self.turns_left is None or self.turns + self.turns_left == 0:
            return self.finished / max(self.episodes, 1)
        return self.turns / (self.turns + self.turns_left) if self.turns_left else 1.0


@dataclasses.dataclass
class _LiveEpisode:
    slot: int  # the pool slot, also its row in its wave (the sampler row of the turn-batched engine)
    task_id: int
    group_id: int
    sample_idx: int
    seed: int  # what its draws fold in: (group_offset + task index) * group_size + sample, the same
    # episode's number whichever process (or engine run) plays it
    horizon: int  # the most policy turns it may take
    replay: tuple[str, ...] = ()  # actions sent before the policy's first turn (`run(replay=...)`)
    transcript: Transcript | None = None  # None until reset succeeded
    pending: tuple[int, ...] = ()  # observation ids to append before the next turn
    status: EpisodeStatus | None = None
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    invalid_actions: int = 0
    invalid_in_a_row: int = 0
    sample_s: float = 0.0
    env_s: float = 0.0
    row: int = -1  # slots: the sampler row it holds, -1 when none
    turn_ids: list[int] = dataclasses.field(default_factory=list)  # slots: the turn being sampled
    turn_logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_versions: list[int] = dataclasses.field(default_factory=list)  # slots: each token's policy version
    turn_experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # slots: the chunks' [tokens, layers, k]
    versions: list[int] = dataclasses.field(default_factory=list)  # slots: every sampled token's, in order


class RolloutEngine:
    """Plays batches of episodes with one sampler over one `EnvPool`. See the module docstring.

    `run` is synchronous, also in a notebook cell: it drives the pool on the engine's own event
    loop (on a thread of its own) and opens the pool there on first use (pass an unopened
    `EnvPool`; `close()` closes it). Code that already runs an event loop with an open pool awaits
    `run_async` instead. A run closes its sessions at its end (so the evaluation's and the
    training's engines of one job share a server's session cap). `task_info=None` asks the
    pool's server for it.
    """

    def __init__(
        self,
        sampler: Sampler,
        framing: ChatFraming,
        pool: EnvPool,
        task_info: TaskInfo | None,
        config: RolloutConfig,
        *,
        turn_lengths: Callable[[int, int, int], int] | None = None,
    ):
        """`turn_lengths(task_id, sample_idx, turn)` (benchmarks) forces each turn's length."""
        eot = set(framing.end_of_turn_ids)
        if not eot <= set(sampler.config.eot_ids):
            raise ValueError(
                f"the sampler must stop on the framing's end-of-turn ids {sorted(eot)}, "
                f"it stops on {list(sampler.config.eot_ids)}; build it with config.sampling_config(framing)"
            )
        if not sampler.config.return_raw_logprobs:
            raise ValueError("the sampler must return raw log-probs (what trajectories store); "
                             "build it with config.sampling_config(framing)")
        if config.record_experts and not sampler.config.return_experts:
            raise ValueError("rollout.record_experts needs a sampler that returns the experts; "
                             "build it with config.sampling_config(framing)")
        if config.tool_calls and framing.tool_error:
            raise ValueError(f"rollout.tool_calls: {framing.tool_error}")
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
        self.turn_lengths = turn_lengths
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
        on_progress: Callable[[RolloutProgress], None] | None = None,
        replay: Sequence[Sequence[str]] | None = None,
    ) -> list[Trajectory]:
        """Plays `task_ids` x `group_size` episodes of at most `horizon` turns each.

        Returns one trajectory per slot, in slot order (task-major): group id
        `group_offset + task index`, `sample_idx` the index within the group. `replay[i]`, if
        given: the actions every episode of task i replays before the policy plays (see the
        module docstring).
        `on_progress(RolloutProgress)`, if given, hears how far the run is (episodes finished,
        turns played, tokens decoded), before every sampler call and at the end (on the engine's
        event-loop thread): a progress bar's count and ETA.
        """
        return self._open().run(self.run_async(
            params, task_ids, horizon, rng, policy_version=policy_version, group_offset=group_offset,
            on_progress=on_progress, replay=replay,
        ))

    async def run_async(
        self,
        params: Params,
        task_ids: Sequence[int],
        horizon: int,
        rng: jax.Array,
        *,
        policy_version: int,
        group_offset: int = 0,
        on_progress: Callable[[RolloutProgress], None] | None = None,
        replay: Sequence[Sequence[str]] | None = None,
    ) -> list[Trajectory]:
        """`run` for callers inside an event loop, with the pool already open in it."""
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 turn, got {horizon}")
        if len(task_ids) == 0:
            raise ValueError("run needs at least one task id")
        replay = [()] * len(task_ids) if replay is None else [tuple(actions) for actions in replay]
        if len(replay) != len(task_ids):
            raise ValueError(f"replay has {len(replay)} action lists for {len(task_ids)} tasks")
        if self.task_info is None:
            self.task_info = await self.pool.tasks()
        # The sampler's copy of the params (bf16 under bf16 compute), made once for the whole run.
        params = self.sampler.sampling_params(params)
        rollout = (_SlotRollout if self.config.num_slots else _Rollout)(self, params, rng)
        n = self.config.group_size
        # Every episode of a wave is reset before any is stepped, so a wave holds at most as many
        # episodes as the pool holds sessions (a bounded pool, e.g. one browser per session).
        wave = await self.pool.session_capacity()
        samples = [(i, int(task), j) for i, task in enumerate(task_ids) for j in range(n)]
        episodes = [
            _LiveEpisode(slot=k % wave, task_id=task, group_id=group_offset + i, sample_idx=j, seed=(group_offset + i) * n + j,
                         horizon=horizon, replay=replay[i])
            for k, (i, task, j) in enumerate(samples)
        ]
        if on_progress is not None:
            rollout.on_progress = lambda: on_progress(rollout.progress(episodes))
        try:
            for start in range(0, len(episodes), wave):
                await rollout.play(episodes[start : start + wave])
                rollout.on_progress()
        finally:  # the servers' room goes back to them: another engine's pool may need it
            await self.pool.close_sessions()
        rollout.episodes = episodes
        self.last_stats = rollout.stats()
        return [self._trajectory(ep, policy_version) for ep in episodes]

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the engine's event loop, its pool open, without waiting for it (a
        stream of episode groups played beside training: `rollout/stream.py`)."""
        return self._open().submit(coro)

    def _open(self) -> LoopThread:
        """The engine's event loop, its pool opened there on first use."""
        if self._loop is None:
            self._loop = LoopThread("rollout-engine")
        if not self._pool_opened:
            self._loop.run(self.pool.__aenter__())
            self._pool_opened = True
        return self._loop

    def forced_lengths(self, episodes: Sequence[_LiveEpisode]) -> list[int] | None:
        """Each episode's forced length of its next turn (0: free), or None without `turn_lengths`."""
        if self.turn_lengths is None:
            return None
        return [
            self.turn_lengths(ep.task_id, ep.sample_idx, ep.transcript.num_turns) if ep.transcript else 0
            for ep in episodes
        ]

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

    def _trajectory(self, ep: _LiveEpisode, policy_version: int) -> Trajectory:
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

    def __init__(self, engine: RolloutEngine, params: Params, rng: jax.Array, version: int = 0):
        self.engine = engine
        self.sampler = engine.sampler
        self.config = engine.config
        self.params = params
        self.version = version  # the policy version of `params` (slots record it per sampled token)
        self.rng = rng
        self.episodes: list[_LiveEpisode] = []
        self.state: SamplerState | None = None
        self.ready: set[int] = set()  # rows whose next turn can be sampled
        self.in_flight = 0  # environment steps outstanding
        self.arrived = asyncio.Event()
        self.failure: Exception | None = None
        self.steps: set[asyncio.Task] = set()
        self.start = time.monotonic()
        self.busy_s = self.wait_s = 0.0
        self.calls = self.turns = self.cache_slots = 0
        self.work_at_start = dataclasses.replace(self.sampler.work)
        self.on_progress: Callable[[], None] = lambda: None  # `run`'s `on_progress`, given `progress(...)`

    def stats(self) -> RolloutStats:
        work = self.sampler.work.minus(self.work_at_start)
        return RolloutStats(
            time.monotonic() - self.start, self.busy_s, self.wait_s, self.calls, self.turns,
            decode_row_steps=work.decode_row_steps, decode_live_steps=work.decode_live_steps,
            prompt_tokens_computed=work.prompt_tokens_computed, observation_tokens_computed=work.observation_tokens_computed,
            prompt_tokens=sum(ep.transcript.prompt_len for ep in self.episodes if ep.transcript),
            cache_slots=self.cache_slots,
        )

    def progress(self, episodes: Sequence[_LiveEpisode]) -> RolloutProgress:
        """How far the run over `episodes` (every wave's) has got."""
        live = [ep for ep in episodes if ep.status is None]
        return RolloutProgress(
            finished=len(episodes) - len(live), episodes=len(episodes), turns=self.turns,
            tokens=self.sampler.work.decode_live_steps - self.work_at_start.decode_live_steps,
            turns_left=sum(ep.horizon - (ep.transcript.num_turns if ep.transcript else 0) for ep in live),
        )

    async def play(self, episodes: list[_LiveEpisode]) -> None:
        self.episodes, self.state = episodes, None  # a wave: the run's next episodes, rows from 0
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
            if self.state is not None:
                self.cache_slots += int(np.asarray(self.state.cache.index)[: len(episodes)].sum())
        finally:
            for task in self.steps:  # only left over when something raised
                task.cancel()

    async def _reset_episodes(self) -> None:
        """Resets every episode's environment, starts its transcript (a failed reset: its status)
        and replays its prefix."""
        start = time.monotonic()
        await asyncio.gather(*(self._open_episode(ep) for ep in self.episodes))
        self.wait_s += time.monotonic() - start

    async def _open_episode(self, ep: _LiveEpisode) -> None:
        pool = self.engine.pool
        self._start_transcript(ep, await self._timed(ep, pool.reset(ep.slot, ep.task_id, tools=self.config.tool_calls)))
        for action in ep.replay:
            if ep.status is not None:
                return
            result = await self._timed(ep, pool.step(ep.slot, action))
            if result.status is not None:  # the replay left no state to play from: nothing the policy did
                ep.status = EpisodeStatus.INFRA_ERROR if result.status.is_scored else result.status
                return
            ep.transcript.add_replayed_turn(action, result.observation)

    def _start_transcript(self, ep: _LiveEpisode, reset: SlotResult) -> None:
        """The episode's first prompt from its reset's answer (a failed reset: its status)."""
        if reset.status is not None:
            ep.status = reset.status
            return
        info = self.engine.task_info
        ep.transcript = Transcript.start(self.engine.framing, info.instruction, reset.observation, self.config.prompt_style,
                                         tools=reset.info["tools"] if self.config.tool_calls else None)

    async def _reset_and_prefill(self) -> None:
        await self._reset_episodes()
        self.ready.update(ep.slot for ep in self.episodes if ep.status is None)
        if not self.ready:
            return
        pad = [self.sampler.config.pad_id]
        prompts = [ep.transcript.token_ids if ep.status is None else pad for ep in self.episodes]
        self.state = await self._in_sampler(lambda: self.sampler.prefill(self.params, prompts), sorted(self.ready))

    async def _timed(self, ep: _LiveEpisode, request) -> SlotResult:
        start = time.monotonic()
        try:
            return await request
        finally:
            ep.env_s += time.monotonic() - start

    async def _in_sampler(self, call, rows: Sequence[int]):
        """Runs a sampler call in a worker thread (the event loop keeps serving environments)."""
        self.on_progress()  # the episodes that ended since the last call
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
        limits = [self._turn_limit(ep) if in_call[ep.slot] else 0 for ep in self.episodes]
        seeds = [(ep.seed, ep.transcript.num_turns if ep.transcript else 0) for ep in self.episodes]
        self.calls += 1
        overflow, turn = await self._in_sampler(lambda: self._append_and_generate(in_call, chunks, limits, seeds), rows)
        for row in rows:
            if overflow[row]:  # its observation did not fit (`turn` is None when no row's did)
                self._end_turn(self.episodes[row], np.zeros(0, np.int32), np.zeros(0, np.float32), StopReason.CACHE_FULL)
                continue
            count = int(turn.count[row])
            # Unfiltered log-probs at the sampling temperature: the policy the trainer recomputes.
            self._end_turn(self.episodes[row], turn.tokens[row, :count], turn.raw_logprobs[row, :count], turn.stop[row],
                           self._recorded(turn.experts, row, count))

    def _recorded(self, experts: np.ndarray | None, row: int, count: int) -> np.ndarray | None:
        """The experts [count, layers, k] of `row`'s first `count` sampled tokens where the rollout keeps them."""
        if not self.config.record_experts:
            return None
        if experts is None:
            raise ValueError("rollout.record_experts needs a mixture-of-experts policy; this sampler's model routes no experts")
        return experts[row, :count]

    def _end_turn(self, ep: _LiveEpisode, ids: np.ndarray, logprobs: np.ndarray, stop: int,
                  experts: np.ndarray | None = None) -> None:
        """Records a sampled turn (with its experts, where kept) and sends it as the action (or
        ends the episode on a budget)."""
        if len(ids) == 0:  # no room left in the cache: the pending observation is not kept
            ep.status = EpisodeStatus.TOKEN_BUDGET
            return
        self.turns += 1
        if ep.pending:
            ep.transcript.add_observation(ids=ep.pending)
            ep.pending = ()
        ep.transcript.add_policy_turn(ids, logprobs, experts)
        stop = StopReason(int(stop))
        if stop is StopReason.CACHE_FULL or (
            stop is StopReason.TOKEN_LIMIT and ep.transcript.response_len >= self.config.max_response_length
        ):
            ep.status = EpisodeStatus.TOKEN_BUDGET
            return
        text = self.engine.framing.tokenizer.decode(ids, skip_special_tokens=True)
        if self.config.tool_calls:
            text = tool_use.action_of(text)
        self.in_flight += 1
        task = asyncio.create_task(self._step(ep, text))
        self.steps.add(task)
        task.add_done_callback(self.steps.discard)

    def _turn_limit(self, ep: _LiveEpisode) -> int:
        """This turn's token limit: the per-turn limit, or what is left of the episode's budget."""
        budget = self.config.max_response_length - ep.transcript.response_len - len(ep.pending)
        return min(self.config.max_tokens_per_turn, budget)

    def _append_and_generate(
        self, in_call: np.ndarray, chunks: list[tuple[int, ...]], limits: list[int], seeds: list[tuple[int, int]]
    ) -> tuple[np.ndarray, TurnOutput | None]:
        """(worker thread) -> (overflow [rows] bool, the turn or None if every row overflowed)."""
        live = np.zeros(self.state.live.shape, bool)
        live[: len(in_call)] = in_call
        state = self.state.replace(live=live)  # only this call's rows take part
        overflow = np.zeros(in_call.shape, bool)
        if any(chunks):
            state, overflow = self.sampler.append(self.params, state, chunks)
        turn = None
        if not overflow[in_call].all():  # rows that overflowed are no longer live
            forced = self.engine.forced_lengths(self.episodes)
            state, turn = self.sampler.generate(self.params, state, self.rng, limit=limits, seeds=seeds, forced=forced,
                                                chunk=self.config.decode_chunk)
        self.state = state
        return overflow, turn

    async def _step(self, ep: _LiveEpisode, action: str) -> None:
        """Sends one action; ends the episode or queues its observation ids for the next turn."""
        try:
            result = await self._timed(ep, self.engine.pool.step(ep.slot, action))
            self._after_step(ep, result)
        except Exception as e:  # surfaced by the sampler loop, not lost in a task
            self.failure = e
        finally:
            self.in_flight -= 1
            self.arrived.set()

    def _after_step(self, ep: _LiveEpisode, result: SlotResult) -> None:
        ep.turn_rewards.append(result.reward)
        invalid = bool(result.info.get("invalid_action"))
        ep.invalid_actions += invalid
        ep.invalid_in_a_row = ep.invalid_in_a_row + 1 if invalid else 0
        limit = self.config.invalid_action_limit
        if result.status is not None:
            ep.status = result.status
        elif limit and ep.invalid_in_a_row >= limit:
            ep.status = EpisodeStatus.INVALID_ACTION_LIMIT
        elif ep.transcript.num_turns >= ep.horizon:
            ep.status = EpisodeStatus.MAX_TURNS
        else:
            ids = ep.transcript.observation_ids(result.observation)
            if ep.transcript.response_len + len(ids) >= self.config.max_response_length:
                ep.status = EpisodeStatus.TOKEN_BUDGET  # no room to sample after the observation
            else:
                ep.pending = ids
                self.ready.add(ep.slot)


def _prompt(ep: _LiveEpisode) -> tuple[int, ...]:
    return tuple(ep.transcript.token_ids[: ep.transcript.prompt_len])


class _SlotRollout(_Rollout):
    """Continuous batching: `num_slots` sampler rows shared by any number of episodes.

    Decode runs in chunks of `decode_chunk` steps over the rows whose turn is in progress only
    (`Sampler.decode_chunk` gathers them). Between chunks the host admits waiting episodes into
    free rows (each distinct prompt prefilled once; the episodes that share it, a task's group,
    copy it from a row that holds it, see `_admit`), appends the observations that arrived
    meanwhile (only those rows are computed) and starts their next turn, while the other rows
    keep decoding; an episode that ended frees its row. So no episode waits for the slowest turn
    of a batch, and rows waiting on their environment or left empty cost no decode steps.
    """

    async def play(self, episodes: list[_LiveEpisode]) -> None:
        self.episodes = episodes
        try:
            await self._reset_all()
            waiting = [ep for ep in episodes if ep.status is None]
            self.ready.clear()
            if not waiting:
                return
            await self._start_slots()
            self._queue(waiting)
            while self.waiting or self.in_flight or any(self.holder):
                if not await self._tick() and self.in_flight:
                    await self._wait_idle()
                if self.failure is not None:
                    raise self.failure
        finally:
            for task in self.steps:  # only left over when something raised
                task.cancel()

    async def _start_slots(self) -> None:
        """The sampler's `num_slots` rows, all free, and the host's view of them."""
        num_slots = self.config.num_slots
        self.state = await asyncio.to_thread(self.sampler.init_slots, self.params, num_slots)
        batch = self.state.live.shape[0]
        self.turn = Turn.start(np.zeros((batch,), bool), np.zeros((batch,), np.int32))
        self.index = np.zeros((batch,), np.int64)  # host copy of each row's tokens (0: free)
        self.holder: list[_LiveEpisode | None] = [None] * batch
        self.free = list(range(num_slots))
        self.waiting: collections.deque[_LiveEpisode] = collections.deque()  # reset, waiting for a row
        # prompt -> its next-token logits (host), kept while an episode with it waits for a row
        self.prompt_logits: dict[tuple[int, ...], np.ndarray] = {}
        self.prompts_waiting: collections.Counter = collections.Counter()

    def _queue(self, episodes: Sequence[_LiveEpisode]) -> None:
        """Episodes whose reset answered, in the order they take rows."""
        self.waiting.extend(episodes)
        self.prompts_waiting.update(_prompt(ep) for ep in episodes)

    async def _tick(self) -> bool:
        """Frees the rows of ended episodes, admits waiting ones, appends arrived observations and
        decodes one chunk. False when there was nothing to compute (every live episode waits on its
        environment)."""
        for row, ep in enumerate(self.holder):  # episodes that ended give their row back
            if ep is not None and ep.status is not None:
                self.cache_slots += int(self.index[row])
                self.holder[row], self.index[row] = None, 0
                self.free.append(row)
        admitted = []
        self.free.sort()  # the lowest rows first (decode gathers the active rows wherever they are)
        while self.free and self.waiting:
            ep = self.waiting.popleft()
            ep.row = self.free.pop(0)
            self.holder[ep.row] = ep
            admitted.append(ep)
        arrived = sorted((self.episodes[i] for i in self.ready), key=lambda ep: ep.row)
        self.ready.clear()
        if admitted or arrived:
            await self._in_sampler(lambda: self._fill(admitted, arrived), [ep.slot for ep in admitted + arrived])
        if self.turn.active.any():
            await self._decode_chunk()
            return True
        return bool(admitted or arrived)

    async def _wait_idle(self) -> None:
        """Waits, counted as the sampler's wait, for the next arrival."""
        start = time.monotonic()
        await self._next_arrival(None)
        self.wait_s += time.monotonic() - start

    async def _reset_all(self) -> None:
        await self._reset_episodes()
        self._check_prompts(self.episodes)

    def _check_prompts(self, episodes: Sequence[_LiveEpisode]) -> None:
        for ep in episodes:
            if ep.transcript is not None and ep.transcript.prompt_len > self.sampler.max_cache_len:
                raise ValueError(
                    f"prompt of {ep.transcript.prompt_len} tokens exceeds max_cache_len={self.sampler.max_cache_len}"
                )

    def _admit(self, admitted: list[_LiveEpisode]) -> None:
        """(worker thread) Puts the admitted episodes' prompts into their rows. Each distinct
        prompt is prefilled once, in the row of its first episode, unless a row held by an earlier
        episode starts with it (its group's); the others copy the prompt's slots from that row
        and take its next-token logits (kept on the host while a group member waits)."""
        now = {ep.row for ep in admitted}
        source: dict[tuple[int, ...], int] = {}  # prompt -> a row, not admitted now, that starts with it
        for row, ep in enumerate(self.holder):
            if ep is not None and row not in now and _prompt(ep) in self.prompt_logits:
                source.setdefault(_prompt(ep), row)
        first: dict[tuple[int, ...], int] = {}  # prompt -> the row that prefills it
        for ep in admitted:
            if _prompt(ep) not in source:
                first.setdefault(_prompt(ep), ep.row)
        rows = list(first.values())
        if rows:
            self.state = self.sampler.fill(self.params, self.state, rows, list(first), [True] * len(rows), self.index)
            self.index[rows] = [len(p) for p in first]
            self.prompt_logits.update(zip(first, self.sampler.row_logits(self.state, rows)))
            source.update(first)
        shared = [ep for ep in admitted if ep.row != source[_prompt(ep)]]
        if shared:
            lengths = [len(_prompt(ep)) for ep in shared]
            self.state = self.sampler.copy_prefix(
                self.state, [source[_prompt(ep)] for ep in shared], [ep.row for ep in shared], lengths,
                np.stack([self.prompt_logits[_prompt(ep)] for ep in shared]),
            )
            self.index[[ep.row for ep in shared]] = lengths
        for ep in admitted:
            self.prompts_waiting[_prompt(ep)] -= 1
            if not self.prompts_waiting[_prompt(ep)]:
                self.prompt_logits.pop(_prompt(ep), None)

    def _fill(self, admitted: list[_LiveEpisode], arrived: list[_LiveEpisode]) -> None:
        """(worker thread) Puts the admitted episodes' prompts into their rows (`_admit`), appends
        the arrived observations, and starts all their turns."""
        if admitted:
            self._admit(admitted)
        fits = [ep for ep in arrived if self.index[ep.row] + len(ep.pending) <= self.sampler.max_cache_len]
        for ep in arrived:
            if ep not in fits:  # no room left in the cache: the pending observation is not kept
                ep.status = EpisodeStatus.TOKEN_BUDGET
        if fits:
            rows = [ep.row for ep in fits]
            self.state = self.sampler.fill(
                self.params, self.state, rows, [ep.pending for ep in fits], [False] * len(rows), self.index
            )
            self.index[rows] += [len(ep.pending) for ep in fits]
        starting = []
        for ep in admitted + fits:
            if self._turn_limit(ep) > 0:
                starting.append(ep)
            else:  # no token left in the episode's budget
                ep.status = EpisodeStatus.TOKEN_BUDGET
        rows = np.asarray([ep.row for ep in starting], np.int64)
        forced = self.engine.forced_lengths(starting)
        turn = self.turn
        turn.active[rows] = True
        turn.count[rows] = 0
        turn.limit[rows] = [self._turn_limit(ep) for ep in starting]
        turn.forced[rows] = forced if forced is not None else 0
        turn.seeds[rows] = [(ep.seed, ep.transcript.num_turns) for ep in starting]
        turn.stop[rows] = StopReason.TOKEN_LIMIT
        for ep in starting:
            ep.turn_ids, ep.turn_logprobs, ep.turn_versions, ep.turn_experts = [], [], [], []

    async def _decode_chunk(self) -> None:
        """One chunk of decode steps; turns that ended are recorded and sent as actions."""
        rows = np.flatnonzero(self.turn.active)
        count = self.turn.count.copy()
        steps = self.config.decode_chunk
        self.state, self.turn, (tokens, _, raw_logprobs, experts, index) = await self._in_sampler(
            lambda: self.sampler.decode_chunk(self.params, self.state, self.turn, self.rng, steps, self.index),
            [self.holder[row].slot for row in rows],
        )
        self.calls += 1
        for row in rows:
            ep = self.holder[row]
            n = int(self.turn.count[row] - count[row])
            ep.turn_ids += tokens[row, :n].tolist()
            ep.turn_logprobs += raw_logprobs[row, :n].tolist()  # unfiltered, at the sampling temperature
            ep.turn_versions += [self.version] * n
            if (chunk := self._recorded(experts, row, n)) is not None:
                ep.turn_experts.append(chunk)
            self.index[row] = index[row]
            if not self.turn.active[row]:
                ep.versions += ep.turn_versions
                self._end_turn(ep, np.asarray(ep.turn_ids, np.int32), np.asarray(ep.turn_logprobs, np.float32),
                               self.turn.stop[row], np.concatenate(ep.turn_experts) if ep.turn_experts else None)
