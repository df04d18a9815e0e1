"""The SQL environment: result comparison, the read-only connection's refusals, time limit and
row cap, the generated tasks, the oracle on every test id, a real server (execute, answer,
refusals, session caps, statements stopped at the wall-clock limit whatever they run, runaway
statements beside a short one, capped results) and a deterministic cached build. The shared
endpoint/bad-input/determinism tests run it too (`tests/test_environments.py`)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import os
import random
import re
import sqlite3
import subprocess
import sys
import time

import pytest

from environments.sql import database, tasks, workers
from environments.sql.env import MAX_TURNS, SHOWN_ROWS, SHOWN_VALUE_CHARS, SQLEnv, same_result, strip_fences
from tests.servers import REPO, request_json, start_server


@pytest.fixture(scope="module")
def db_path():
    return database.ensure_built()


@pytest.fixture(scope="module")
def url():
    with start_server("sql", timeout_s=600) as base:
        yield base


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_result_comparison():
    assert same_result([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=False)
    assert not same_result([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=True)
    assert not same_result([(1,), (1,)], [(1,)], ordered=False)  # multisets, not sets
    assert same_result([(3.0,), (0.1 + 0.2,)], [(3,), (0.3,)], ordered=True)  # 3.0 == 3; 6 decimals
    assert not same_result([(12.34,)], [(12.3,)], ordered=False)
    assert not same_result([(1, "a")], [(1,)], ordered=False)  # the column count matters
    assert same_result([(None,)], [(None,)], ordered=False)


def test_the_database_holds_the_package_tables(db_path):
    conn = database.ReadOnlyConnection(db_path)
    counts = {t: conn.query(f"SELECT COUNT(*) FROM {t}")[1][0][0] for t in database.SCHEMA}
    # the package's row counts (flights: every 10th of 336,776 rows)
    assert counts == {"airlines": 16, "airports": 1458, "planes": 3322, "weather": 26115, "flights": 33678}
    first = conn.query("SELECT year, month, day, dep_time, carrier, flight, origin, dest FROM flights LIMIT 1")[1]
    assert first == [(2013, 1, 1, 517, "UA", 1545, "EWR", "IAH")]  # the package's first row
    assert conn.query("SELECT COUNT(*) FROM flights WHERE dep_time IS NULL")[1][0][0] > 0  # "NA" -> NULL
    conn.close()


@pytest.mark.parametrize("sql, refused", [
    ("INSERT INTO airlines VALUES ('ZZ', 'Nowhere Air')", "INSERT"),
    ("UPDATE flights SET dep_delay = 0", "UPDATE"),
    ("DELETE FROM planes", "DELETE"),
    ("DROP TABLE weather", "changing the database schema"),
    ("CREATE TABLE t (a)", "changing the database schema"),
    ("CREATE TEMP VIEW v AS SELECT 1", "changing the database schema"),
    ("ATTACH DATABASE '/tmp/other.sqlite' AS other", "ATTACH"),
    ("SELECT load_extension('/tmp/evil.so')", "the function load_extension"),
    ("SELECT fts3_tokenizer('simple')", "the function fts3_tokenizer"),  # returns a memory address
    ("PRAGMA journal_mode = WAL", "PRAGMA journal_mode"),
    ("BEGIN", "TRANSACTION"),
])
def test_writes_attach_and_extensions_are_refused(db_path, sql, refused):
    before = _sha(db_path)
    conn = database.ReadOnlyConnection(db_path)
    with pytest.raises(database.QueryError, match=f"refused: {refused}.*read-only"):
        conn.query(sql)
    assert conn.query("SELECT COUNT(*) FROM airlines")[1] == [(16,)]  # the connection still works
    conn.close()
    assert _sha(db_path) == before


def test_the_file_is_opened_read_only_beneath_the_authorizer(db_path):
    conn = database.ReadOnlyConnection(db_path)
    conn._conn.set_authorizer(None)  # take the first wall away: mode=ro still refuses the write
    with pytest.raises(database.QueryError, match="readonly"):
        conn.query("INSERT INTO airlines VALUES ('ZZ', 'Nowhere Air')")
    conn.close()


def test_time_limit_row_cap_and_errors(db_path):
    conn = database.ReadOnlyConnection(db_path, time_limit_s=0.2, max_rows=50)
    endless = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT COUNT(*) FROM r"
    with pytest.raises(database.QueryError, match=r"0.2 s \(CPU\) time limit"):
        conn.query(endless)
    columns, rows, more = conn.query("SELECT origin, dest FROM flights")
    assert columns == ["origin", "dest"] and len(rows) == 50 and more
    assert conn.query("SELECT carrier FROM airlines")[2] is False  # 16 rows: all read
    with pytest.raises(database.QueryError, match="syntax error"):
        conn.query("SELEC 1")
    with pytest.raises(database.QueryError, match="one statement at a time"):
        conn.query("SELECT 1; SELECT 2")
    with pytest.raises(database.QueryError, match="too big"):
        conn.query("SELECT randomblob(2000000)")
    assert conn.query("PRAGMA table_info(airlines)")[1][0][1] == "carrier"  # read-only pragmas work
    conn.close()


def test_tasks_span_three_levels_with_non_empty_gold(db_path):
    all_tasks = tasks.ensure_tasks(db_path)
    levels = collections.Counter(t.level for t in all_tasks)
    assert set(levels) == {"easy", "medium", "hard"} and min(levels.values()) >= 100
    assert {t.template for t in all_tasks} == set(tasks.TEMPLATES)
    conn = database.ReadOnlyConnection(db_path)
    for task in all_tasks:
        rows = conn.query(task.sql)[1]
        assert 0 < len(rows) <= tasks.MAX_GOLD_ROWS and tuple(rows) == task.gold, task  # stored gold = the query's rows
    ordered = [t for t in all_tasks if t.ordered]
    assert ordered and all("first" in t.question for t in ordered)  # an ordered question says the order
    conn.close()


def test_oracle_solves_every_test_id():
    test_ids = SQLEnv.task_info().splits["test"]
    solved = 0
    for task in test_ids:
        env = SQLEnv()
        env.reset(task)
        result = env.step(SQLEnv.parse_action(f"Thought: the gold query.\nAction: {env.oracle_action()}"))
        solved += result.done and result.reward == 1.0 and result.info["success"]
        env.close()
    assert solved == len(test_ids) and len(test_ids) >= 40


def _new_episode(url: str, task: int) -> int:
    session = request_json(url, "POST", "/create", {})[1]["id"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": task})
    assert status == 200 and reset["observation"].startswith("Question: ")
    return session


def test_execute_shows_rows_errors_and_refusals_through_the_server(url):
    session = _new_episode(url, 0)
    multi_line = "Thought: look.\nAction:\n```sql\nexecute SELECT carrier, name\nFROM airlines\nORDER BY carrier\n```"
    _, result = request_json(url, "POST", "/step", {"id": session, "action": multi_line})
    lines = result["observation"].split("\n")
    assert lines[0] == "carrier | name" and lines[1] == "9E | Endeavor Air Inc." and lines[-1] == "(16 rows)"
    assert not result["done"] and result["reward"] == 0 and not result["info"]["invalid_action"]
    _, many = request_json(url, "POST", "/step", {"id": session, "action": "Action: execute SELECT * FROM flights"})
    assert many["observation"].endswith(f"(more than {database.MAX_ROWS} rows, showing the first {SHOWN_ROWS})")
    assert len(many["observation"].split("\n")) == SHOWN_ROWS + 2
    _, error = request_json(url, "POST", "/step", {"id": session, "action": "Action: execute SELECT nope FROM flights"})
    assert error["observation"].startswith("Error: OperationalError: no such column: nope") and error["info"]["sql_error"]
    _, refused = request_json(url, "POST", "/step", {"id": session, "action": "Action: execute DELETE FROM flights"})
    assert "refused: DELETE is not allowed" in refused["observation"] and not refused["done"]
    _, invalid = request_json(url, "POST", "/step", {"id": session, "action": "Action: SELECT 1"})
    assert invalid["info"]["invalid_action"] and "execute <SQL>" in invalid["observation"]
    _, still = request_json(url, "POST", "/step", {"id": session, "action": "execute SELECT COUNT(*) FROM airlines"})
    assert still["observation"].split("\n")[1] == "16"  # nothing was deleted
    request_json(url, "POST", "/close", {"id": session})


def test_answers_are_compared_with_gold_with_order_only_when_asked(url):
    info = request_json(url, "GET", "/tasks")[1]
    all_tasks = tasks.ensure_tasks(database.ensure_built())
    ordered = next(i for i, t in enumerate(all_tasks) if t.ordered and t.template == "top_destinations")
    unordered = next(i for i, t in enumerate(all_tasks) if t.template == "carrier_flights_per_origin")
    assert info["metadata"]["templates"][ordered] == "top_destinations"

    def answer(task: int, sql: str) -> dict:
        session = _new_episode(url, task)
        result = request_json(url, "POST", "/step", {"id": session, "action": f"Action: answer {sql}"})[1]
        request_json(url, "POST", "/close", {"id": session})
        return result

    gold = all_tasks[ordered].sql
    assert answer(ordered, gold)["reward"] == 1.0
    # the same rows, reversed: wrong where the question fixes the order
    reversed_rows = f"SELECT * FROM ({gold}) ORDER BY n ASC"
    wrong = answer(ordered, reversed_rows)
    assert wrong["done"] and wrong["reward"] == 0 and "incorrect" in wrong["observation"]
    gold = all_tasks[unordered].sql
    assert answer(unordered, f"{gold} ORDER BY COUNT(*) DESC")["reward"] == 1.0  # any order where none is asked
    assert answer(unordered, gold.replace("SELECT origin, COUNT(*)", "SELECT COUNT(*)"))["reward"] == 0
    failed = answer(unordered, "SELECT * FROM nowhere")
    assert failed["done"] and failed["reward"] == 0 and "no such table" in failed["info"]["sql_error"]


def test_action_parsing_keeps_multi_line_sql_and_drops_code_fences():
    parse = SQLEnv.parse_action
    assert parse("Thought: count.\nAction:\n```sql\nexecute SELECT COUNT(*)\nFROM flights\n```") == \
        "execute SELECT COUNT(*)\nFROM flights"
    env = SQLEnv()
    env.reset(0)
    result = env.step(parse("Action: execute ```SELECT COUNT(*) FROM airlines```"))  # fences around the SQL only
    assert result.observation.split("\n")[1] == "16" and not result.info["invalid_action"]
    assert parse("Thought: nothing to do.\nAction:   ") is None
    env.close()


def test_fences_are_stripped_as_the_regex_strips_them_in_linear_time():
    """`strip_fences` against the regex it replaces (`\\s*```$` tried after every whitespace: 60 KB
    of spaces held a server 10 s), over random texts, then on 1 MB."""
    fence = re.compile(r"^```(?:[a-zA-Z]+\n)?\s*|\s*```$")
    pieces = ["```", "sql", "\n", " ", "\t", "x", "`", "SELECT 1"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert strip_fences(text) == fence.sub("", text.strip()).strip(), text
    start = time.monotonic()
    assert strip_fences("execute" + " " * 1_000_000 + "x```") == "execute" + " " * 1_000_000 + "x"
    assert time.monotonic() - start < 0.5


def test_the_turn_limit_ends_an_episode():
    env = SQLEnv()
    env.reset(0)
    for turn in range(1, MAX_TURNS + 1):
        result = env.step("execute SELECT 1")
        assert result.done == (turn == MAX_TURNS) and result.reward == 0
    assert "used all" in result.observation and not env.verify()
    env.close()


# One function call that runs for seconds between two VM instructions (9 s of CPU measured),
# where SQLite's CPU-time check never runs: only killing its process stops it.
PRINTF_BOMB = "Action: execute SELECT printf('%.*c', 2000000000, 'x')"
KILLED_BY_S = workers.WALL_LIMIT_S


def _step_timed(url: str, session: int, action: str) -> tuple[float, dict]:
    start = time.monotonic()
    status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
    assert status == 200, result
    return time.monotonic() - start, result


def test_a_statement_stops_at_the_wall_clock_limit_whatever_it_runs(url):
    session = _new_episode(url, 0)
    seconds, result = _step_timed(url, session, PRINTF_BOMB)
    assert "time limit" in result["observation"] and not result["done"], result["observation"]
    assert seconds < KILLED_BY_S + 1.5, f"stopped after {seconds:.1f} s"
    _, after = _step_timed(url, session, "Action: execute SELECT COUNT(*) FROM airlines")
    assert after["observation"].split("\n")[1] == "16"  # the session goes on, on a fresh worker
    request_json(url, "POST", "/close", {"id": session})


def test_results_are_capped_in_bytes_and_long_values_cut_in_the_observation(url):
    session = _new_episode(url, 0)
    _, huge = _step_timed(url, session, "Action: execute SELECT printf('%.*c', 999999, 'x') FROM flights LIMIT 10")
    assert "larger than 4,000,000 bytes" in huge["observation"] and len(huge["observation"]) < 1000
    _, cut = _step_timed(url, session, "Action: execute SELECT printf('%.*c', 5000, 'x') AS v")
    assert cut["observation"].split("\n")[1] == "x" * SHOWN_VALUE_CHARS + "... (5000 characters)"
    request_json(url, "POST", "/close", {"id": session})


def test_runaway_statements_do_not_hold_up_another_sessions_query():
    """Two sessions' statements that never yield fill both threads of a 2-thread server; a third
    session's short query waits only until they are killed at the limit (9 s of CPU each before)."""
    with start_server("sql", threads=2, timeout_s=600) as small:
        bombers, asker = [_new_episode(small, 0) for _ in range(2)], _new_episode(small, 1)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bombs = [pool.submit(_step_timed, small, s, PRINTF_BOMB) for s in bombers]
            time.sleep(0.3)
            seconds, result = _step_timed(small, asker, "Action: execute SELECT COUNT(*) FROM airlines")
            assert result["observation"].split("\n")[1] == "16"
            assert seconds < KILLED_BY_S + 2.5, f"a short query waited {seconds:.1f} s behind runaway ones"
            for bomb in bombs:
                bomb_s, bombed = bomb.result()
                assert "time limit" in bombed["observation"] and bomb_s < KILLED_BY_S + 2.5


def test_session_cap():
    with start_server("sql", max_sessions=2, timeout_s=600) as capped:  # may build the database first
        ids = [request_json(capped, "POST", "/create", {})[1]["id"] for _ in range(2)]
        status, body = request_json(capped, "POST", "/create", {})
        assert status == 503 and "session cap 2" in body["error"]
        request_json(capped, "POST", "/close", {"id": ids[0]})
        assert request_json(capped, "POST", "/create", {})[0] == 200


@pytest.mark.slow  # a full rebuild: 30-70 s on 2 loaded cores
def test_build_is_deterministic_across_processes(tmp_path, db_path):
    """A fresh build in another process (another hash seed) gives the same file and tasks as the cache."""
    script = ("import sys, pathlib; from environments.sql import database, tasks; "
              "tasks.ensure_tasks(database.ensure_built(pathlib.Path(sys.argv[1])))")
    env = {**os.environ, "PYTHONHASHSEED": "2", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, cwd=REPO, timeout=300)
    fresh = tmp_path / database.DB_VERSION
    tasks_file = f"tasks-{tasks.TASKS_VERSION}.json"
    assert _sha(fresh / "nycflights13.sqlite") == _sha(db_path)
    assert (fresh / tasks_file).read_text() == (db_path.parent / tasks_file).read_text()
    with contextlib.closing(sqlite3.connect(fresh / "nycflights13.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*) FROM flights").fetchone() == (33678,)
