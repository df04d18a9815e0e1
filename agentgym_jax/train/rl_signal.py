"""RL episodes that carry signal: a replayed-prefix curriculum, pass-rate-targeted tasks and
dynamic sampling that draws more groups (docs/algorithms.md, "Groups that carry signal").

    source = rl_signal.Steered(plan, engine, settings.signal(config), rules, position)  # an rl_episodes source
    trajectories, metrics = source.take(step, policy)

Step s, synchronous like `rl_episodes.Synchronous`:
1. its tasks: `play.task_batch` over the curriculum's pool (`sampling="uniform"`), or drawn with
   weights that peak at the target pass rate (`"pass_rate"`, `rl/pass_rate.py`) from
   `rng(seed, s)`; this process plays its share;
2. with `replay`, each episode starts k turns into its task's oracle demonstration: the task's
   demonstration is played once, when the task is first drawn (`play_oracle_episodes`, the
   job's demonstrations' way), and the engine replays its first k actions into each episode's
   own session (`RolloutEngine.run(replay=)`); k is the task's (or its grade's, `replay_by`),
   capped at the demonstration's turns before the last;
3. with `rules.max_extra_groups`, while fewer of this process's groups have mixed returns
   (`rl_batch.signal_groups`) than it has tasks, it draws and plays more tasks (from
   `rng(seed, s, draw, process)`), up to the cap, and keeps as many groups as it has tasks, mixed
   ones first: the batch keeps its shape;
4. every process's groups update, in process order, each task's pass rate and each task's (or
   grade's) k (`ReplayControl.next` on the group's, or the grade's groups', success), so every
   process holds the same state.
The state (pass rates, k, the demonstrations' lengths) is the source's `position()`, saved in
each checkpoint's meta; a resumed run restores it and draws, replays and plays what the
uninterrupted run did. The trajectories carry their k (`replay_turns`) and `curriculum`
(`pass_rate`: the task's before the step, `stage`: the horizon schedule's).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.job import play
from agentgym_jax.parallel.distributed import gather_objects, process_share
from agentgym_jax.rl.curriculum import grades
from agentgym_jax.rl.pass_rate import PassRate, ReplayControl, draw_tasks, sampling_weights
from agentgym_jax.rollout.demonstrations import ACTION_ONLY, play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutEngine
from agentgym_jax.rollout.rl_batch import BatchFilter, signal_groups
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train.rl_episodes import Policy, StepPlan, Synchronous

SAMPLINGS = ("uniform", "pass_rate")
_DRAW_KEY, _EXTRA_KEY = 0x50415353, 0x45585452  # apart from `task_batch`'s rng([seed, epoch])


@dataclasses.dataclass(frozen=True)
class SignalSettings:
    """`config.curriculum`'s pass-rate keys and the oracle that demonstrates (`config.sft`)."""

    target: float = 0.5  # the group pass rate both controls aim at
    sampling: str = "uniform"  # one of SAMPLINGS
    sampling_floor: float = 0.1  # pass_rate: the weight of a task solved always or never (1 at the target)
    pass_rate: PassRate = PassRate()
    replay: ReplayControl | None = None  # None: every episode starts at the task's start
    replay_by: str = ""  # "": a k per task; a task-metadata grading (e.g. "depth"): a k per grade
    oracle: str = ""  # the environment's oracle that demonstrates ("" its default)
    action_format: str = ACTION_ONLY
    oracle_horizon: int = 100  # a demonstration longer than this is not replayed

    def __post_init__(self):
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling={self.sampling!r} is not one of {', '.join(SAMPLINGS)}")
        sampling_weights([], self.target, self.sampling_floor)  # refuses a bad floor
        if self.replay is not None and self.replay.target != self.target:
            raise ValueError(f"the replay's target {self.replay.target} differs from target_pass_rate {self.target}")
        if self.replay_by and self.replay is None:
            raise ValueError(f"replay_by={self.replay_by!r} grades the replay, which is off: set replay=True")

    def steers(self, rules: BatchFilter) -> bool:
        """Whether a run needs this source (else `rl_episodes`' plain ones do the same)."""
        return self.replay is not None or self.sampling != "uniform" or rules.max_extra_groups > 0


class Standing:
    """Where the controls stand: each task's pass rate, each unit's k (a unit: a task, or a grade
    with `replay_by`), each demonstrated task's oracle turns (0: none to replay). What a checkpoint
    keeps (`position`), the same on every process."""

    def __init__(self, settings: SignalSettings, metadata: Mapping[str, Any], position: Mapping[str, Any]):
        self.settings = settings
        self.grade = grades(metadata, settings.replay_by) if settings.replay_by else None
        self.pass_rates: dict[int, float] = {int(t): float(r) for t, r in position.get("pass_rates", [])}
        self.replay_turns: dict[Any, int] = {u: int(k) for u, k in position.get("replay_turns", [])}
        self.oracle_turns: dict[int, int] = {int(t): int(n) for t, n in position.get("oracle_turns", [])}

    def position(self) -> dict[str, list]:
        return {name: [list(item) for item in sorted(table.items())] for name, table in
                (("pass_rates", self.pass_rates), ("replay_turns", self.replay_turns), ("oracle_turns", self.oracle_turns))}

    def unit(self, task: int) -> Any:
        return task if self.grade is None else self.grade[task]

    def weights(self, task_ids: Sequence[int]) -> np.ndarray:
        """The tasks' sampling weights: equal (`uniform`), or peaked at the target pass rate."""
        if self.settings.sampling == "uniform":
            return np.ones(len(task_ids))
        return sampling_weights([self.pass_rates.get(t) for t in task_ids], self.settings.target, self.settings.sampling_floor)

    def turns(self, task: int) -> int:
        """The oracle turns `task`'s episodes replay now (its demonstration known): its unit's k (the
        first k of a unit never played), at most the demonstration's turns before the last."""
        if self.settings.replay is None:
            return 0
        most = max(self.oracle_turns[task] - 1, 0)
        unit = self.unit(task)
        return min(self.replay_turns[unit], most) if unit in self.replay_turns else self.settings.replay.first(most)

    def observe(self, outcomes: Sequence[Sequence[int]]) -> None:
        """Folds a step's groups, `[task, k, successes, scored, oracle turns]` each (every
        process's, in process order), into the pass rates and k: a unit's k moves on the mean
        success of its groups this step (`ReplayControl.next`; a unit's first k is the most its
        groups replayed). A group with no scored episode says nothing."""
        played: dict[Any, list[tuple[int, float]]] = collections.defaultdict(list)
        for task, k, successes, scored, oracle_turns in outcomes:
            self.oracle_turns.setdefault(task, oracle_turns)
            if scored:
                self.pass_rates[task] = self.settings.pass_rate.update(self.pass_rates.get(task), successes / scored)
                played[self.unit(task)].append((k, successes / scored))
        if self.settings.replay is None:
            return
        for unit, groups in played.items():
            k = self.replay_turns.get(unit, max(k for k, _ in groups))
            self.replay_turns[unit] = self.settings.replay.next(k, sum(r for _, r in groups) / len(groups), self.most(unit))

    def most(self, unit: Any) -> int:
        """The most turns a unit replays: its (grade's) demonstrations' turns before the last."""
        tasks = [unit] if self.grade is None else [t for t in self.oracle_turns if self.grade[t] == unit]
        return max(max(self.oracle_turns.get(t, 0) - 1, 0) for t in tasks)

    def summary(self) -> dict[str, Any]:
        """Where the controls ended (the report's `curriculum`)."""
        turns = list(self.replay_turns.values())
        return {"tasks_played": len(self.pass_rates),
                **({"replay_units": len(turns), "replay_units_from_start": sum(k == 0 for k in turns),
                    "replay_turns_mean": sum(turns) / len(turns) if turns else 0.0} if self.settings.replay else {})}


@dataclasses.dataclass
class _Group:
    """One played group of this process: its task, where it started and how it did."""

    task: int
    replay_turns: int
    trajectories: list[Trajectory]


class Steered(Synchronous):
    """An RL step's episodes with the pass-rate controls on. See the module docstring."""

    def __init__(self, plan: StepPlan, engine: RolloutEngine, settings: SignalSettings, rules: BatchFilter,
                 position: Mapping[str, Any]):
        super().__init__(plan, engine)
        self.settings, self.rules = settings, rules
        self.standing = Standing(settings, plan.info.metadata, position)
        self.demonstrations: dict[int, tuple[str, ...]] = {}  # task -> its oracle's actions (played again after a resume)

    def take(self, step: int, policy: Policy) -> tuple[list[Trajectory], dict[str, float]]:
        pool = self.plan.curriculum.pool(self.plan.info.splits["train"], self.plan.info.metadata, step)
        tasks, first = process_share(self._draw(pool, step), "rollout.batch_tasks")
        groups, times = self._play(step, policy, tasks, first)
        needed, drawn, draws = len(tasks), set(tasks), 0
        while (mixed := self._mixed(groups)) < needed and (left := self.rules.max_extra_groups - (len(groups) - needed)):
            share = mixed / len(groups)  # of the groups played so far: how many more to draw for the missing ones
            draws += 1
            extra = self._draw_extra(pool, drawn, min(left, math.ceil((needed - mixed) / share) if share else needed), step, draws)
            drawn.update(extra)
            more, more_times = self._play(step, policy, extra, self._extra_offset(draws))
            groups += more
            times = {k: times[k] + more_times[k] for k in times}
        kept = self._keep(groups, needed)
        before = dict(self.standing.pass_rates)
        local = {"groups": [[g.task, g.replay_turns, sum(t.success for t in g.trajectories),
                             sum(t.status.is_scored for t in g.trajectories), self.standing.oracle_turns.get(g.task, 0)]
                            for g in groups],
                 "kept": [any(g is k for k in kept) for g in groups], "draws": draws, "mixed": self._mixed(kept)}
        shares = gather_objects(local)
        self.standing.observe([row for share in shares for row in share["groups"]])
        stage = self.plan.schedule.stage(step)
        trajectories = [dataclasses.replace(t, curriculum={"stage": stage, **({"pass_rate": before[g.task]} if g.task in before else {})})
                        for g in kept for t in g.trajectories]
        return trajectories, {"horizon": self.plan.schedule.horizon(step), "task_pool": len(pool), **times,
                              **self._metrics(shares, before)}

    def position(self) -> dict[str, Any]:
        return self.standing.position()

    def summary(self) -> dict[str, Any]:
        """The controls a run used and where they ended (its report's `curriculum`)."""
        s, replay = self.settings, self.settings.replay
        return {"target_pass_rate": s.target, "sampling": s.sampling, "max_extra_groups": self.rules.max_extra_groups,
                "replay": replay is not None,
                **({"replay_by": s.replay_by or "task", "replay_start": replay.start, "replay_band": replay.band} if replay else {}),
                **self.standing.summary()}

    # -- tasks -----------------------------------------------------------------------------------

    def _draw(self, pool: list[int], step: int) -> list[int]:
        """The step's tasks, every process's (the same list on each)."""
        if self.settings.sampling == "uniform":
            return play.task_batch(pool, step, self.plan.batch_tasks, self.plan.seed)
        rng = np.random.default_rng([self.plan.seed, step, _DRAW_KEY])
        return draw_tasks(pool, self.standing.weights(pool), self.plan.batch_tasks, rng)

    def _draw_extra(self, pool: list[int], drawn: set[int], count: int, step: int, draw: int) -> list[int]:
        """`count` more tasks for this process, none drawn this step while the pool has others."""
        fresh = [t for t in pool if t not in drawn] or pool
        rng = np.random.default_rng([self.plan.seed, step, _EXTRA_KEY, draw, jax.process_index()])
        return draw_tasks(fresh, self.standing.weights(fresh), count, rng)

    def _extra_offset(self, draw: int) -> int:
        """The first group id of this process's extra draw `draw` (>= 1): apart from every other
        process's and draw's, and from the batch's own groups."""
        return self.plan.batch_tasks + ((draw - 1) * jax.process_count() + jax.process_index()) * self.rules.max_extra_groups

    # -- playing -----------------------------------------------------------------------------------

    def _play(self, step: int, policy: Policy, tasks: list[int], first: int) -> tuple[list[_Group], dict[str, float]]:
        n = self.engine.config.group_size
        if self.settings.replay is not None and (missing := [t for t in dict.fromkeys(tasks) if t not in self.demonstrations]):
            self._demonstrate(missing)
        turns = [self.standing.turns(t) for t in tasks]
        replay = [self.demonstrations[t][:k] for t, k in zip(tasks, turns)] if self.settings.replay else None
        trajectories, times = self.play(step, policy, tasks, first, replay)
        return [_Group(t, k, trajectories[i * n : (i + 1) * n]) for i, (t, k) in enumerate(zip(tasks, turns))], times

    def _demonstrate(self, tasks: list[int]) -> None:
        """Plays the oracle on `tasks` (concurrently) for their demonstrations; an unsuccessful one replays nothing."""
        s = self.settings
        episodes = self.engine.submit(play_oracle_episodes(
            self.engine.pool, tasks, horizon=s.oracle_horizon, action_format=s.action_format, oracle=s.oracle)).result()
        for ep in episodes:
            actions = tuple(turn.action for turn in ep.turns) if ep.status is EpisodeStatus.SUCCESS else ()
            self.demonstrations[ep.data_idx] = actions
            self.standing.oracle_turns[ep.data_idx] = len(actions)

    # -- what the groups say -----------------------------------------------------------------------

    def _mixed(self, groups: list[_Group]) -> int:
        return len(signal_groups([t for g in groups for t in g.trajectories], self.rules))

    def _keep(self, groups: list[_Group], count: int) -> list[_Group]:
        """`count` groups, those with mixed returns first, in the order played."""
        if len(groups) == count:
            return groups
        mixed = signal_groups([t for g in groups for t in g.trajectories], self.rules)
        order = sorted(range(len(groups)), key=lambda i: (groups[i].trajectories[0].group_id not in mixed, i))
        return [groups[i] for i in sorted(order[:count])]

    def _metrics(self, shares: list[dict], before: dict[int, float]) -> dict[str, float]:
        """The step's k, its tasks' pass rates and its extra draws, over every process."""
        kept = [row for share in shares for row, keep in zip(share["groups"], share["kept"]) if keep]
        metrics: dict[str, float] = {"pass_rate/known_tasks": len(self.standing.pass_rates)}
        if known := [before[row[0]] for row in kept if row[0] in before]:
            metrics["pass_rate/drawn_mean"] = sum(known) / len(known)
        if self.settings.replay is not None:
            turns = [row[1] for row in kept]
            metrics.update({"replay/turns_mean": sum(turns) / len(turns), "replay/turns_max": max(turns),
                            "replay/from_start": sum(k == 0 for k in turns) / len(turns)})
        if self.rules.max_extra_groups:
            metrics.update({"dynamic_sampling/extra_groups": sum(len(share["groups"]) for share in shares) - len(kept),
                            "dynamic_sampling/draws": sum(share["draws"] for share in shares),
                            "dynamic_sampling/mixed_groups": sum(share["mixed"] for share in shares)})
        return metrics
