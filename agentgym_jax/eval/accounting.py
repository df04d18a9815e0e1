"""Honest evaluation accounting: which record counts, and every rate with its denominator.

Definitions (docs/evaluation.md):
- scheduled episodes = tasks x samples; a (task, sample) without any record is `missing`.
- success: a scored episode (`EpisodeStatus.is_scored`) whose reward reaches the environment's
  success threshold.
- end-to-end success = successes / scheduled (infra errors, env timeouts and missing episodes
  count as failures); conditional success = successes / scored episodes, labelled as such;
  infra rate = infra errors / scheduled. Rates come with Wilson 95% score intervals.
- a retry of a (task, sample) is an extra `attempt`; the last attempt is the one that counts,
  and the number of retries is reported. Two records of the same (task, sample, attempt) are an
  error, never silently merged.
- pass@k is Chen et al.'s unbiased estimator per task, averaged over tasks; pass^k (Yao et al.'s
  tau-bench, AgentGym2's reliability measure) the chance that k samples drawn from a task's n all
  succeed; avg@k is the mean success over the k samples of a task, averaged over tasks.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.stats import wilson_interval

MISSING = "missing"  # status label of a scheduled (task, sample) that has no record at all


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """What accounting needs of one terminal episode (a view of a `Trajectory`, no tokens)."""

    env: str
    task_id: int
    sample_idx: int
    attempt: int
    reward: float  # the episode score on the environment's own scale
    status: EpisodeStatus
    num_turns: int
    invalid_actions: int

    @classmethod
    def from_trajectory(cls, t: Trajectory) -> EpisodeRecord:
        return cls(
            env=t.env,
            task_id=t.task_id,
            sample_idx=t.sample_idx,
            attempt=t.attempt,
            reward=float(t.reward),
            status=EpisodeStatus(t.status),
            num_turns=t.num_turns,
            invalid_actions=t.invalid_actions,
        )

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.env, self.task_id, self.sample_idx)


@dataclasses.dataclass(frozen=True)
class CountedEpisode:
    """One scheduled (task, sample) after retries are resolved; `record` is None if missing."""

    env: str
    task_id: int
    sample_idx: int
    record: EpisodeRecord | None
    success: bool
    retries: int  # records of this (task, sample) besides the one that counts
    status_mismatch: bool = False  # scored, and status `success` disagrees with the threshold rule

    @property
    def status(self) -> str:
        return MISSING if self.record is None else self.record.status.value

    @property
    def is_scored(self) -> bool:
        return self.record is not None and self.record.status.is_scored


@dataclasses.dataclass(frozen=True)
class Rate:
    """`numerator / denominator` with its Wilson 95% interval; all None when nothing was counted."""

    numerator: int
    denominator: int
    value: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, numerator: int, denominator: int) -> Rate:
        if denominator == 0:
            return cls(numerator, 0, None, None, None)
        low, high = wilson_interval(numerator, denominator)
        return cls(numerator, denominator, numerator / denominator, low, high)


@dataclasses.dataclass(frozen=True)
class Metrics:
    """The metrics of one environment (or of all, pooled over episodes)."""

    scheduled: int
    num_tasks: int
    group_size: int
    success: Rate  # end-to-end: successes / scheduled
    conditional_success: Rate  # successes / scored episodes only
    infra_rate: Rate  # infra errors / scheduled
    mean_score: float | None  # end-to-end mean reward (unscored and missing count 0); None across scales
    mean_score_scored: float | None  # mean reward over scored episodes; None across scales
    pass_at_k: dict[int, float]  # k -> unbiased pass@k averaged over tasks (end-to-end)
    pass_hat_k: dict[int, float]  # k -> pass^k: all k attempts succeed, unbiased, averaged over tasks
    avg_at_k: float  # mean success over the k = group_size samples of a task, averaged over tasks
    invalid_action_rate: float | None  # invalid actions / policy turns, over scored episodes
    mean_turns: float | None  # over scored episodes
    status_counts: dict[str, int]  # every EpisodeStatus value plus `missing`, zeros included
    retries: int
    status_mismatches: int  # scored episodes whose status and reward disagree (an engine bug)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021): P(at least one of k samples drawn from n, c of them correct, passes)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k (Yao et al., 2024): P(all of k samples drawn from n, c of them correct, pass) = C(c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return math.comb(c, k) / math.comb(n, k)


def default_ks(group_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `group_size`."""
    return tuple(sorted({2**i for i in range(group_size.bit_length()) if 2**i <= group_size} | {group_size}))


def counted_episodes(
    records: Iterable[EpisodeRecord | Trajectory],
    thresholds: Mapping[str, float],
    group_size: int,
    task_ids: Mapping[str, Sequence[int]] | None = None,
) -> list[CountedEpisode]:
    """The scheduled episodes, sorted, each with the record that counts (its last attempt).

    `thresholds`: env -> success threshold (`TaskInfo.success_threshold`). `task_ids`: env -> the
    scheduled task ids; by default the tasks that have records. Raises `ValueError` on two
    records of one (task, sample, attempt), on records outside the schedule, and on envs without
    a threshold.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    by_key: dict[tuple[str, int, int], dict[int, EpisodeRecord]] = collections.defaultdict(dict)
    for r in records:
        r = EpisodeRecord.from_trajectory(r) if isinstance(r, Trajectory) else r
        attempts = by_key[r.key]
        if r.attempt in attempts:
            raise ValueError(
                f"two terminal records for env={r.env!r} task={r.task_id} sample={r.sample_idx} "
                f"attempt={r.attempt}; a retry must be recorded as a new attempt"
            )
        attempts[r.attempt] = r
    if task_ids is None:
        scheduled_tasks: dict[str, set[int]] = collections.defaultdict(set)
        for env, task, _ in by_key:
            scheduled_tasks[env].add(task)
    else:
        scheduled_tasks = {env: set(ids) for env, ids in task_ids.items()}
    for env, task, sample in by_key:
        if task not in scheduled_tasks.get(env, ()) or not 0 <= sample < group_size:
            raise ValueError(
                f"record env={env!r} task={task} sample={sample} is not scheduled "
                f"(group_size={group_size}, scheduled envs: {sorted(scheduled_tasks)})"
            )
    unknown = sorted(set(scheduled_tasks) - set(thresholds))
    if unknown:
        raise ValueError(f"no success threshold for env(s) {unknown}; given: {sorted(thresholds)}")

    episodes = []
    for env in sorted(scheduled_tasks):
        for task in sorted(scheduled_tasks[env]):
            for sample in range(group_size):
                attempts = by_key.get((env, task, sample), {})
                record = attempts[max(attempts)] if attempts else None
                scored = record is not None and record.status.is_scored
                success = scored and record.reward >= thresholds[env]
                mismatch = scored and (record.status == EpisodeStatus.SUCCESS) != success
                retries = max(len(attempts) - 1, 0)
                episodes.append(CountedEpisode(env, task, sample, record, success, retries, mismatch))
    return episodes


def compute_metrics(
    episodes: Sequence[CountedEpisode], group_size: int, ks: Sequence[int] | None = None, same_scale: bool = True
) -> Metrics:
    """Metrics of `episodes` (all scheduled samples of each of their tasks).

    `same_scale=False` (several environments pooled) leaves the mean scores out: averaging a
    0-100 score with a 0-1 score means nothing.
    """
    ks = tuple(ks) if ks is not None else default_ks(group_size)
    if any(not 1 <= k <= group_size for k in ks):
        raise ValueError(f"every k must be in 1..{group_size} (group_size), got {ks}")
    per_task: dict[tuple[str, int], list[CountedEpisode]] = collections.defaultdict(list)
    for e in episodes:
        per_task[(e.env, e.task_id)].append(e)
    if any(len(group) != group_size for group in per_task.values()):
        raise ValueError(f"every task needs exactly group_size={group_size} scheduled episodes")

    scheduled = len(episodes)
    scored = [e for e in episodes if e.is_scored]
    successes = sum(e.success for e in episodes)
    counts = collections.Counter(e.status for e in episodes)
    status_counts = {s.value: counts[s.value] for s in EpisodeStatus} | {MISSING: counts[MISSING]}
    turns = sum(e.record.num_turns for e in scored)
    rewards = [e.record.reward for e in scored]
    task_successes = [sum(e.success for e in group) for group in per_task.values()]

    def task_mean(values: Iterable[float]) -> float:
        values = list(values)
        return sum(values) / len(values) if values else 0.0

    return Metrics(
        scheduled=scheduled,
        num_tasks=len(per_task),
        group_size=group_size,
        success=Rate.of(successes, scheduled),
        conditional_success=Rate.of(successes, len(scored)),
        infra_rate=Rate.of(counts[EpisodeStatus.INFRA_ERROR.value], scheduled),
        mean_score=sum(rewards) / scheduled if same_scale and scheduled else None,
        mean_score_scored=sum(rewards) / len(rewards) if same_scale and rewards else None,
        pass_at_k={k: task_mean(pass_at_k(group_size, c, k) for c in task_successes) for k in ks},
        pass_hat_k={k: task_mean(pass_hat_k(group_size, c, k) for c in task_successes) for k in ks},
        avg_at_k=task_mean(c / group_size for c in task_successes),
        invalid_action_rate=sum(e.record.invalid_actions for e in scored) / turns if turns else None,
        mean_turns=turns / len(scored) if scored else None,
        status_counts=status_counts,
        retries=sum(e.retries for e in episodes),
        status_mismatches=sum(e.status_mismatch for e in episodes),
    )


@dataclasses.dataclass(frozen=True)
class EvalSummary:
    per_env: dict[str, Metrics]
    overall: Metrics  # pooled over all episodes of all environments
    episodes: list[CountedEpisode]  # the counted episodes, for per-task views and plots

    def to_json(self) -> dict:
        """Plain JSON: rates as {numerator, denominator, value, low, high}; episodes left out."""
        return {
            "per_env": {env: dataclasses.asdict(m) for env, m in self.per_env.items()},
            "overall": dataclasses.asdict(self.overall),
        }


def summarize(
    records: Iterable[EpisodeRecord | Trajectory],
    thresholds: Mapping[str, float],
    group_size: int,
    task_ids: Mapping[str, Sequence[int]] | None = None,
    ks: Sequence[int] | None = None,
) -> EvalSummary:
    """Per-environment and overall metrics of an evaluation run (see `counted_episodes`)."""
    episodes = counted_episodes(records, thresholds, group_size, task_ids)
    by_env: dict[str, list[CountedEpisode]] = collections.defaultdict(list)
    for e in episodes:
        by_env[e.env].append(e)
    per_env = {env: compute_metrics(group, group_size, ks) for env, group in sorted(by_env.items())}
    overall = compute_metrics(episodes, group_size, ks, same_scale=len(per_env) <= 1)
    return EvalSummary(per_env=per_env, overall=overall, episodes=episodes)


def task_success_rates(episodes: Iterable[CountedEpisode]) -> dict[tuple[str, int], float]:
    """(env, task) -> end-to-end success rate over its scheduled samples."""
    groups: dict[tuple[str, int], list[bool]] = collections.defaultdict(list)
    for e in episodes:
        groups[(e.env, e.task_id)].append(e.success)
    return {key: sum(v) / len(v) for key, v in sorted(groups.items())}
