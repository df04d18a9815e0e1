"""SQL over a real database (AgentGym's BIRD / SQLGym role): answer questions about nycflights13.

Each turn is `Action: execute <SQL>` (runs one statement and shows its first `SHOWN_ROWS` rows, or
the error) or `Action: answer <SQL>` (ends the episode). Reward 1 when the answer's result set
equals the gold query's: as multisets of rows, or as lists when the question fixes the order;
column names do not matter, column count and values do (floats compared at 6 decimals, 3.0
equals 3). Every statement runs on a read-only connection (`database.py`) in a worker process
shared by the sessions (`workers.py`): writes, ATTACH, schema changes and functions that load
code or hand out memory addresses are refused with a message saying so, a statement stops after
`STATEMENT_TIME_LIMIT_S` of CPU time or `workers.WALL_LIMIT_S` of wall-clock time whatever it
runs, and at most `MAX_ROWS` rows (and `MAX_RESULT_BYTES`) are read. An episode ends unanswered after `MAX_TURNS` turns.

Tasks: `tasks.py`'s templates over the database, at three levels; oracle: the gold SQL.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any, ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment, every_kth_held_out
from environments.sql import database, tasks, workers

MAX_TURNS = 20
SHOWN_ROWS = 20  # rows of an `execute` result written into the observation
SHOWN_VALUE_CHARS = 200  # characters of one value written into the observation (values reach 1 MB)
TEST_EVERY = 10  # task ids divisible by this form the test split
FLOAT_DIGITS = 6  # result values are compared rounded to this many decimals

_ACTION = re.compile(r"^(execute|answer)\b\s*(.*)$", re.IGNORECASE | re.DOTALL)
_FENCE_LANGUAGE = re.compile(r"[a-zA-Z]+\n")  # the `sql` of a ```sql fence
_MARKER = re.compile(r"Action:\s*", re.IGNORECASE)


def strip_fences(text: str) -> str:
    """`````sql\nSELECT 1```` -> `SELECT 1`: a leading fence (with a language name) and a trailing
    one removed, with the whitespace around the text. Linear time, unlike a regex that looks for
    a closing fence after every run of whitespace."""
    text = text.strip()
    if text.startswith("```"):
        text = text[3:]
        if language := _FENCE_LANGUAGE.match(text):
            text = text[language.end():]
    if text.endswith("```"):
        text = text[:-3]
    return text.strip()


def _schema_text() -> str:
    return "\n".join(f"{s};" for s in database.create_statements())


INSTRUCTION = (
    "You answer questions about flights from New York City in 2013 by querying a read-only SQLite "
    "database (the nycflights13 data; the flights table holds every tenth flight of the full data). "
    f"Its tables:\n{_schema_text()}\n"
    "Each turn, write one action:\n"
    "- execute <SQL>: runs one SELECT statement and shows the first rows of its result or the error;\n"
    "- answer <SQL>: submits the SELECT statement whose result answers the question; this ends the episode.\n"
    "The answer's result must hold exactly the values asked for (column names do not matter); keep "
    "the row order only when the question asks for one.\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nexecute SELECT ..."
)
INVALID = ("Invalid action: write `execute <SQL>` to run a query or `answer <SQL>` to submit the query "
           "that answers the question.")


@functools.lru_cache(maxsize=None)
def _db_path():
    return database.ensure_built()


@functools.lru_cache(maxsize=None)
def _tasks() -> tuple[tasks.Task, ...]:
    return tuple(tasks.ensure_tasks(_db_path()))


def _normal(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() else round(value, FLOAT_DIGITS)
    return value


def same_result(got: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], ordered: bool) -> bool:
    """Row lists equal (ordered) or equal as multisets, after `_normal` on every value."""
    got_rows = [tuple(_normal(v) for v in row) for row in got]
    gold_rows = [tuple(_normal(v) for v in row) for row in gold]
    if ordered:
        return got_rows == gold_rows
    return collections.Counter(got_rows) == collections.Counter(gold_rows)


def _shown(value: Any) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS]}... ({len(text)} characters)"


def render(columns: list[str], rows: list[tuple[Any, ...]], more: bool) -> str:
    """`a | b` lines: a header, the first `SHOWN_ROWS` rows (long values cut) and a count line."""
    lines = [" | ".join(columns)]
    lines += [" | ".join(_shown(v) for v in row) for row in rows[:SHOWN_ROWS]]
    total = f"more than {len(rows)}" if more else str(len(rows))
    shown = f", showing the first {SHOWN_ROWS}" if len(rows) > SHOWN_ROWS else ""
    return "\n".join(lines + [f"({total} rows{shown})"])


class SQLEnv(Environment):
    """One question over one read-only connection."""

    name: ClassVar[str] = "sql"
    instruction: ClassVar[str] = INSTRUCTION
    blocking: ClassVar[bool] = True  # a statement may run up to the time limit
    oracle_sweep_concurrency: ClassVar[int] = 8

    def __init__(self) -> None:
        self.task: tasks.Task | None = None
        self.turns = 0
        self.answer_rows: list[tuple[Any, ...]] | None = None
        self._observation = ""

    @classmethod
    def task_info(cls) -> TaskInfo:
        all_tasks = _tasks()
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(all_tasks), TEST_EVERY),
            num_tasks=len(all_tasks),
            has_oracle=cls.has_oracle,
            metadata={"levels": [t.level for t in all_tasks], "templates": [t.template for t in all_tasks],
                      "max_turns": MAX_TURNS, "max_rows": database.MAX_ROWS,
                      "statement_cpu_time_limit_s": database.STATEMENT_TIME_LIMIT_S,
                      "statement_wall_time_limit_s": workers.WALL_LIMIT_S,
                      "flight_subsample": database.FLIGHT_SUBSAMPLE, "db_version": database.DB_VERSION},
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """Everything after the last `Action:` (SQL may span lines), code fences removed."""
        parts = _MARKER.split(text)
        action = strip_fences(parts[-1])
        return action or None

    def reset(self, data_idx: int) -> str:
        all_tasks = _tasks()
        if not 0 <= data_idx < len(all_tasks):
            raise ValueError(f"sql task id {data_idx} out of range [0, {len(all_tasks)})")
        self.task = all_tasks[data_idx]
        self.turns, self.answer_rows = 0, None
        self._observation = f"Question: {self.task.question}"
        return self._observation

    def step(self, action: str) -> StepResult:
        self.turns += 1
        out_of_turns = self.turns >= MAX_TURNS
        match = _ACTION.match(action.strip())
        if match is None or not match.group(2).strip():
            return self._end_or_go_on(INVALID, out_of_turns, invalid=True)
        kind, sql = match.group(1).lower(), strip_fences(match.group(2))
        try:
            columns, rows, more = workers.shared_pool().query(sql)
        except database.QueryError as e:
            if kind == "answer":
                self.answer_rows = []
                return self.result(f"Your answer query failed: {e}. The episode is over.", 0.0, True,
                                   invalid=False, sql_error=str(e))
            return self._end_or_go_on(f"Error: {e}", out_of_turns, invalid=False, sql_error=str(e))
        if kind == "execute":
            return self._end_or_go_on(render(columns, rows, more), out_of_turns, invalid=False)
        self.answer_rows = rows if not more else None
        correct = self.verify()
        verdict = "correct" if correct else "incorrect"
        self._observation = f"Your answer is {verdict}. The episode is over."
        return self.result(self._observation, float(correct), True, invalid=False, answer_rows=len(rows))

    def _end_or_go_on(self, observation: str, out_of_turns: bool, invalid: bool, **info: Any) -> StepResult:
        if out_of_turns:
            observation += f"\nYou have used all {MAX_TURNS} turns without an answer. The episode is over."
        self._observation = observation
        return self.result(observation, 0.0, out_of_turns, invalid=invalid, **info)

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """The two action forms, with a query that shows the tables."""
        return ["execute SELECT name, sql FROM sqlite_master WHERE type = 'table'", "answer <SQL>"]

    def verify(self) -> bool:
        """The submitted query's rows equal the gold rows (stored with the task; a truncated result never does)."""
        return self.answer_rows is not None and same_result(self.answer_rows, list(self.task.gold), self.task.ordered)

    def oracle_action(self) -> str:
        return f"answer {self.task.sql}"

    @classmethod
    def on_server_stop(cls) -> None:
        workers.shared_pool().close()
