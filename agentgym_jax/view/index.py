"""The index of a run's episodes: one pass over its JSONL files, an episode read on demand.

Each record's summary (env, task, sample, attempt, step, status, reward, turns, tokens, invalid
actions, failure patterns) goes into numpy columns, with the record's file and byte offset, so
filters and pages are array operations and an episode is one seek and one `json.loads`: a run
of 100k episodes is never held whole (docs/viewer.md has the measured time and memory).

`refresh` reads what a live run appended since (complete lines only; a line still being written
waits for the next refresh) and reads a file again when it was rewritten (a resumed RL run cuts
its trajectory file back to the restored step). A line that is not a trajectory record is
counted in `bad_lines` and skipped: the rest of the run stays readable.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import pathlib
from collections.abc import Collection, Mapping

import numpy as np

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.view.patterns import PATTERNS, flag_bits, patterns

STATUSES = tuple(s.value for s in EpisodeStatus)
FILTER_KEYS = ("env", "status", "pattern", "step", "task", "reward_min", "reward_max")  # URL parameters of `Filter`
# column -> array typecode (numpy's dtype follows from it)
COLUMNS = {
    "file": "h", "line": "q", "offset": "q", "length": "q", "task_id": "q", "sample_idx": "q", "attempt": "q",
    "step": "q", "env": "i", "status": "b", "reward": "d", "turns": "i", "tokens": "i",
    "invalid_actions": "i", "flags": "h",
}
MAX_BAD_LINES = 20  # kept with their reason; the rest only counted


class FilterError(ValueError):
    """A filter value that cannot be read; the server answers it with a 400."""


def step_of(t: Trajectory) -> int:
    """The RL step that trained on an episode, numbered as `metrics.jsonl` and the console number
    it (an RL run's step N plays and trains on the episodes whose `train_step` is N - 1); 0 for an
    episode no update used (an evaluation, the oracle, a collection, a gateway's conversation)."""
    return t.train_step + 1


def run_files(path: pathlib.Path) -> list[pathlib.Path]:
    """A run's trajectory files: a JSONL file given alone, or a folder's `trajectories.jsonl` and
    per-process `trajectories.p<k>.jsonl` (what eval, collect and rl write)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a run folder nor a JSONL file")
    files = [path / "trajectories.jsonl", *sorted(path.glob("trajectories.p*.jsonl"))]
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(
            f"{path} holds no trajectories.jsonl or trajectories.p<k>.jsonl; give an eval, collect or rl "
            "folder, or a trajectory JSONL file (e.g. demonstrations.jsonl, iter_<i>/explored.jsonl)"
        )
    return files


def _empty_columns() -> dict[str, array.array]:
    return {name: array.array(code) for name, code in COLUMNS.items()}


@dataclasses.dataclass
class _FileState:
    """How far one file has been read, and the rows its lines gave."""

    path: pathlib.Path
    inode: int = -1  # -1: not read yet (or absent)
    read_to: int = 0  # bytes indexed (complete lines)
    lines: int = 0
    columns: dict[str, array.array] = dataclasses.field(default_factory=_empty_columns)


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which episodes to list; None (or an empty range) leaves a field unfiltered. Ranges are
    inclusive: `step=(3, 5)` is steps 3, 4 and 5."""

    env: str | None = None
    status: str | None = None
    pattern: str | None = None
    step: tuple[int, int] | None = None
    task: tuple[int, int] | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Filter:
        """From URL parameters: `env`, `status`, `pattern`, `step` and `task` ("7" or "3:9", both
        ends included), `reward_min`, `reward_max`; empty values are no filter."""
        given = {k: v.strip() for k, v in query.items() if v.strip()}
        status, pattern = given.get("status"), given.get("pattern")
        if status is not None and status not in STATUSES:
            raise FilterError(f"status={status!r} is not an episode status; valid: {', '.join(STATUSES)}")
        if pattern is not None and pattern not in PATTERNS:
            raise FilterError(f"pattern={pattern!r} is not a failure pattern; valid: {', '.join(PATTERNS)}")
        return cls(
            env=given.get("env"), status=status, pattern=pattern,
            step=_int_range("step", given.get("step")), task=_int_range("task", given.get("task")),
            reward_min=_number("reward_min", given.get("reward_min")),
            reward_max=_number("reward_max", given.get("reward_max")),
        )


def _int_range(name: str, text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise FilterError(f"{name}={text!r}: want an integer or a range 'a:b' (both ends included)") from None
    if bounds[0] > bounds[1]:
        raise FilterError(f"{name}={text!r} is an empty range")
    return bounds


def _number(name: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise FilterError(f"{name}={text!r} is not a number") from None


class RunIndex:
    """The episodes of one run (a folder or a JSONL file), as columns of `COLUMNS`."""

    def __init__(self, name: str, files: list[pathlib.Path], end_of_turn_ids: Collection[int] | None = None):
        if len(files) > np.iinfo(np.int16).max:
            raise ValueError(f"{len(files)} trajectory files in {name}: more than the index's file column holds")
        self.name = name
        self.end_of_turn_ids = end_of_turn_ids
        self.envs: list[str] = []  # env code -> name
        self.bad_lines: list[str] = []  # the first MAX_BAD_LINES, with their reason
        self.num_bad_lines = 0
        self._env_codes: dict[str, int] = {}
        self._files = [_FileState(path) for path in files]
        self.columns: dict[str, np.ndarray] = {}
        self.refresh()

    @property
    def files(self) -> list[pathlib.Path]:
        return [state.path for state in self._files]

    def __len__(self) -> int:
        return len(self.columns["offset"])

    def refresh(self) -> bool:
        """Indexes the lines written since the last call; True if the index changed."""
        changed = False
        for number, state in enumerate(self._files):
            try:
                stat = os.stat(state.path)
            except FileNotFoundError:
                stat = None
            inode = -1 if stat is None else stat.st_ino
            if inode != state.inode or (stat is not None and stat.st_size < state.read_to):  # replaced or cut
                changed |= len(state.columns["offset"]) > 0
                self._files[number] = state = _FileState(state.path, inode)
            if stat is not None and stat.st_size > state.read_to:
                changed |= self._read(number, state)
        if changed or not self.columns:
            self.columns = {
                name: np.concatenate([np.frombuffer(s.columns[name], dtype=np.dtype(code)) for s in self._files])
                if self._files else np.zeros(0, np.dtype(code))
                for name, code in COLUMNS.items()
            }
        return changed

    def _read(self, number: int, state: _FileState) -> bool:
        """Indexes the complete lines after `state.read_to`."""
        before = state.lines
        with open(state.path, "rb") as f:
            f.seek(state.read_to)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # still being written (or torn by a killed writer): not yet a record
                state.lines += 1
                try:
                    row = self._row(Trajectory.from_json(json.loads(line)))
                except (ValueError, TypeError, KeyError) as e:
                    self._bad_line(state, e)
                else:
                    row.update(file=number, line=state.lines, offset=state.read_to, length=len(line))
                    for name, column in state.columns.items():
                        column.append(row[name])
                state.read_to += len(line)
        return state.lines > before

    def _bad_line(self, state: _FileState, error: Exception) -> None:
        self.num_bad_lines += 1
        if len(self.bad_lines) < MAX_BAD_LINES:
            self.bad_lines.append(f"{state.path}:{state.lines}: {type(error).__name__}: {str(error)[:200]}")

    def _row(self, t: Trajectory) -> dict[str, float | int]:
        if t.env not in self._env_codes:
            self._env_codes[t.env] = len(self.envs)
            self.envs.append(t.env)
        return dict(
            task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt, step=step_of(t),
            env=self._env_codes[t.env], status=STATUSES.index(t.status.value), reward=float(t.reward),
            turns=t.num_turns, tokens=len(t.token_ids), invalid_actions=t.invalid_actions,
            flags=flag_bits(patterns(t, self.end_of_turn_ids)),
        )

    # ---- queries ----

    def select(self, f: Filter) -> np.ndarray:
        """Row numbers of the episodes `f` lets through, in file order."""
        c = self.columns
        keep = np.ones(len(self), bool)
        if f.env is not None:
            keep &= c["env"] == (self._env_codes[f.env] if f.env in self._env_codes else -1)
        if f.status is not None:
            keep &= c["status"] == STATUSES.index(f.status)
        if f.pattern is not None:
            keep &= (c["flags"] & (1 << PATTERNS.index(f.pattern))) != 0
        for name, bounds in (("step", f.step), ("task_id", f.task)):
            if bounds is not None:
                keep &= (c[name] >= bounds[0]) & (c[name] <= bounds[1])
        if f.reward_min is not None:
            keep &= c["reward"] >= f.reward_min
        if f.reward_max is not None:
            keep &= c["reward"] <= f.reward_max
        return np.flatnonzero(keep)

    def summaries(self, rows: np.ndarray) -> list[dict]:
        """One JSON-ready summary per row."""
        c = self.columns
        return [
            dict(
                id=int(r), env=self.envs[c["env"][r]], task_id=int(c["task_id"][r]), sample_idx=int(c["sample_idx"][r]),
                attempt=int(c["attempt"][r]), step=int(c["step"][r]), status=STATUSES[c["status"][r]],
                reward=float(c["reward"][r]), turns=int(c["turns"][r]), tokens=int(c["tokens"][r]),
                invalid_actions=int(c["invalid_actions"][r]),
                patterns=[p for i, p in enumerate(PATTERNS) if c["flags"][r] >> i & 1],
            )
            for r in rows
        ]

    def read(self, row: int) -> Trajectory:
        """The full record of one indexed episode, read from its file."""
        c = self.columns
        with open(self._files[c["file"][row]].path, "rb") as f:
            f.seek(int(c["offset"][row]))
            return Trajectory.from_json(json.loads(f.read(int(c["length"][row]))))

    def location(self, row: int) -> str:
        """`<file>:<line>` of a row (lines counted from 1), where to find its record by hand."""
        return f"{self._files[self.columns['file'][row]].path}:{int(self.columns['line'][row])}"

    def step_counts(self, rows: np.ndarray) -> dict:
        """Per step (policy version) of the rows: episodes, successes and each pattern's count."""
        c = self.columns
        steps, inverse = np.unique(c["step"][rows], return_inverse=True)
        count = lambda weights: np.bincount(inverse, weights, minlength=len(steps)).astype(int).tolist()  # noqa: E731
        flags = c["flags"][rows]
        return dict(
            steps=steps.tolist(), episodes=count(None),
            success=count(c["status"][rows] == STATUSES.index(EpisodeStatus.SUCCESS.value)),
            patterns={p: count((flags >> i) & 1) for i, p in enumerate(PATTERNS)},
        )

    def task_rows(self, env: str, task_id: int) -> np.ndarray:
        """Every episode of one task (all samples, attempts and steps)."""
        return self.select(Filter(env=env, task=(task_id, task_id)))
