"""SQL statements in worker processes, so that every statement stops at a wall-clock limit.

SQLite checks the CPU-time limit (`database.ReadOnlyConnection`'s progress handler) only between
VM instructions, and one function call can run for seconds without one: `printf('%.*c',
2000000000, 'x')` took 9 s. So statements run in worker processes, each with its own read-only
connection, and a worker that has not answered within `WALL_LIMIT_S` is killed, which stops any
function; the next statement gets a fresh worker. The wall-clock limit is looser than the CPU
one so that honest queries on a loaded machine still finish (a load average of ~150 once
stretched a 32 ms query past 2 s).

Fairness: sessions share the workers; a session runs one statement at a time (the server's
session lock), each statement holds a worker of its own, and running workers share the CPUs
(the operating system's scheduler), so a short query beside runaway ones is slowed, not queued.
Statements wait only when every thread of the server's pool is busy, and then each one ahead
of them frees its thread within the limit. Workers are started on demand, one per statement
running at once, so never more than the server's threads, and kept for the next statements.
A worker exits when the server does (its pipe closes).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing.connection
import os
import pathlib
import pickle
import subprocess
import sys
import threading
from typing import Any

from environments.sql import database

log = logging.getLogger(__name__)

WALL_LIMIT_S = 5.0  # a statement's worker is killed past this (the CPU limit inside stops most before)
Result = tuple[list[str], list[tuple[Any, ...]], bool]  # (columns, rows, whether rows were left unread)


class Worker:
    """One worker process and the pipe to it; `run` sends a statement and waits for its answer."""

    def __init__(self, db_path: pathlib.Path, time_limit_s: float):
        to_worker, self._requests = multiprocessing.Pipe(duplex=False)
        self._answers, from_worker = multiprocessing.Pipe(duplex=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "environments.sql.workers", str(to_worker.fileno()), str(from_worker.fileno()),
             str(db_path), repr(time_limit_s)],
            pass_fds=(to_worker.fileno(), from_worker.fileno()), env=env, stdin=subprocess.DEVNULL)
        to_worker.close()  # the worker's ends, now open in the worker only
        from_worker.close()

    def run(self, sql: str, timeout_s: float) -> Result | database.QueryError | None:
        """The statement's result or its `QueryError`; None when no answer came within `timeout_s`."""
        self._requests.send(sql)
        if not self._answers.poll(timeout_s):
            return None
        return self._answers.recv()

    def close(self) -> None:
        """Kills the process (a worker holds nothing worth a polite shutdown)."""
        self._requests.close()
        self._answers.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class WorkerPool:
    """Runs statements on idle workers, starting one when none is idle."""

    def __init__(self, db_path: pathlib.Path, time_limit_s: float = database.STATEMENT_TIME_LIMIT_S,
                 wall_limit_s: float = WALL_LIMIT_S):
        self.db_path = db_path
        self.time_limit_s = time_limit_s  # CPU seconds, checked by the worker
        self.wall_limit_s = wall_limit_s
        self._idle: list[Worker] = []
        self._lock = threading.Lock()

    def query(self, sql: str) -> Result:
        """Runs one statement -> (columns, rows, more); `database.QueryError` when it fails or runs too long."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or Worker(self.db_path, self.time_limit_s)
        try:
            answer = worker.run(sql, self.wall_limit_s)
        except (OSError, EOFError) as e:  # the worker died (killed from outside, out of memory)
            worker.close()
            raise database.QueryError(f"the statement's worker process failed ({type(e).__name__}); try again") from None
        if answer is None:
            log.info("killing a SQL worker whose statement ran past %.1f s: %.200s", self.wall_limit_s, sql)
            worker.close()
            raise database.QueryError(f"the statement ran longer than the {self.wall_limit_s:g} s (wall-clock) "
                                      "time limit and was stopped")
        with self._lock:
            self._idle.append(worker)
        if isinstance(answer, database.QueryError):
            raise answer
        return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


@functools.cache
def shared_pool() -> WorkerPool:
    """The process's pool over the built database."""
    return WorkerPool(database.ensure_built())


def serve(requests_fd: int, answers_fd: int, db_path: str, time_limit_s: float) -> None:
    """The worker's loop: statements in, results (or their `QueryError`) out, until the pipe closes."""
    requests = multiprocessing.connection.Connection(requests_fd, writable=False)
    answers = multiprocessing.connection.Connection(answers_fd, readable=False)
    conn = database.ReadOnlyConnection(pathlib.Path(db_path), time_limit_s)
    while True:
        try:
            sql = requests.recv()
        except EOFError:
            return
        try:
            answer: Any = conn.query(sql)
        except database.QueryError as e:
            answer = e
        try:
            answers.send(answer)
        except pickle.PicklingError as e:  # a value sqlite3 returned that cannot cross (never seen)
            answers.send(database.QueryError(f"the result cannot be sent back: {e}"))


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
