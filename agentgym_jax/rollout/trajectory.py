"""The trajectory record: one episode as the exact token ids the policy saw and produced.

Token in, token out (architecture rule 3): `token_ids` is the prompt, then per turn the ids the sampler
produced followed by the ids appended for the environment's answer. `loss_mask` is 1 exactly on
sampled ids (including the end-of-turn id the policy sampled). `text` is a decoding kept for
reading only; nothing is ever re-tokenized from it.

A mixture of experts' routing may be kept too (`rollout.record_experts`): `experts` holds, per
token id, the experts each layer routed a policy token to as the sampler fed it into its cache
(`expert_record`: "3,5 1,7" is layer 0's experts 3 and 5, layer 1's 1 and 7, most probable
first), "" on every other token, so the trainer can compare its own routing with the sampler's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from agentgym_jax.envs.protocol import EpisodeStatus


@dataclasses.dataclass
class Trajectory:
    task_id: int
    env: str
    group_id: int  # the n samples of one task in one batch share a group id
    token_ids: list[int]
    loss_mask: list[int]  # 1 on policy-sampled ids, 0 on prompt, template and environment ids
    logprobs: list[float]  # sampler log-probs on policy ids (unfiltered, at the sampling temperature), 0.0 elsewhere
    turn_spans: list[tuple[int, int]]  # [start, end) of each policy turn in token_ids
    turn_rewards: list[float]  # environment reward after each turn (none for a last turn never sent)
    reward: float  # outcome reward of the episode
    status: EpisodeStatus
    invalid_actions: int = 0
    sample_idx: int = 0  # which of the n samples of this task
    attempt: int = 0  # retries of the same (task, sample) are new attempts, never new tasks
    policy_version: int = 0  # training step of the params that sampled it (asynchronous RL: of its oldest token)
    token_versions: list[int] = dataclasses.field(default_factory=list)  # per token id, the policy version
    # that sampled it (-1 off the loss mask); empty: every sampled token's is `policy_version`
    train_step: int = -1  # the RL step whose update used it (-1: none, e.g. evaluation)
    replay_turns: int = 0  # oracle turns replayed before the policy's first (in the prompt, loss_mask 0)
    curriculum: dict[str, float] = dataclasses.field(default_factory=dict)  # the task's standing when the
    # RL step drew it (`train/rl_signal.py`: its pass rate, the step's stage); empty outside such a step
    experts: list[str] = dataclasses.field(default_factory=list)  # per token id, a policy token's experts per
    # layer (`expert_record`), "" off the loss mask; empty: not recorded (`rollout.record_experts`)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    text: str = ""

    def __post_init__(self) -> None:
        self.status = EpisodeStatus(self.status)
        self.turn_spans = [tuple(span) for span in self.turn_spans]
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs "
                f"({len(self.logprobs)}) must have the same length"
            )
        if any(not 0 <= start < end <= n for start, end in self.turn_spans):
            raise ValueError(f"a turn span of {self.turn_spans} lies outside the {n} token ids")
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(f"token_versions ({len(self.token_versions)}) must be empty or one per token id ({n})")
        if self.experts and (len(self.experts) != n or any(bool(e) != bool(m) for e, m in zip(self.experts, self.loss_mask))):
            raise ValueError(f"experts must be empty or one per token id ({n}), recorded exactly on the loss mask")
        if len(self.turn_rewards) > len(self.turn_spans):  # the last turn may never have been stepped
            raise ValueError(f"{len(self.turn_rewards)} turn_rewards for {len(self.turn_spans)} turns")

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def last_policy_index(self) -> int:
        """Index of the last policy-sampled token (where the outcome reward sits); -1 if none."""
        return max((i for i, m in enumerate(self.loss_mask) if m), default=-1)

    @property
    def success(self) -> bool:
        return self.status == EpisodeStatus.SUCCESS

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["status"] = self.status.value
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Trajectory:
        return cls(**record)


def expert_record(experts: np.ndarray) -> str:
    """One token's experts `[layers, k]` as a trajectory keeps them: "3,5 1,7" (layer by layer)."""
    return " ".join(",".join(map(str, layer)) for layer in np.asarray(experts).tolist())


def expert_array(records: Sequence[str]) -> np.ndarray:
    """`[len(records), layers, k]` int32 of non-empty `expert_record`s of one shape."""
    layers = records[0].count(" ") + 1
    k = records[0].split(" ", 1)[0].count(",") + 1
    flat = ",".join(records).replace(" ", ",").split(",")
    if len(flat) != len(records) * layers * k or any(r.count(" ") != layers - 1 for r in records):
        raise ValueError(f"expert records of different shapes: the first has {layers} layers x {k} experts")
    return np.asarray(flat).astype(np.int32).reshape(len(records), layers, k)


def write_jsonl(path: str, trajectories: Iterable[Trajectory], append: bool = True) -> None:
    """Appends (or writes) one JSON record per line; flushed and fsynced so a kill loses nothing.
    A full write goes through a temporary file and a rename, so a reader (or a run killed
    mid-write) sees the old file or the whole new one, never an empty or partial one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    target = path if append else path + ".tmp"
    with open(target, "a" if append else "w", encoding="utf-8") as f:
        for trajectory in trajectories:
            f.write(json.dumps(trajectory.to_json(), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if not append:
        os.replace(target, path)


def truncate_jsonl(path: str, before_step: int) -> None:
    """Rewrites `path` keeping only the records with `train_step < before_step` (what a run
    resumed at step `before_step` keeps; it replays the later steps). Atomic."""
    if os.path.exists(path):
        write_jsonl(path, [t for t in read_jsonl(path) if t.train_step < before_step], append=False)


def read_jsonl(path: str) -> Iterator[Trajectory]:
    """Reads records written by `write_jsonl`; a torn last line (killed writer) is skipped."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return  # the writer was killed mid-line; everything before it is intact
            raise
        yield Trajectory.from_json(record)
