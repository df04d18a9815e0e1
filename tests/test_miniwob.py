"""MiniWoB++ in a real headless Chromium: task ids, the page text, the actions, MiniWoB's own reward,
the oracle on the test ids, determinism across server processes, the session cap, idle reaping,
the idle-browser pool, and a browser killed or hung under a live session. Everything but the
task-id and argument checks and the slow-image page runs through `python -m environments.serve`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import os
import re
import signal
import threading
import time

import psutil
import pytest

from environments.miniwob import oracle, tasks
from environments.miniwob.browser import Browser, chromedriver_path, env_number
from environments.miniwob.env import MiniWoBEnv, parse_text_argument
from environments.miniwob.tasks import task_id
from tests.servers import request_json, server_pid, start_server
from tests.test_env_pool import oracle_episodes_watched
from tests.test_environments import _run_oracle


@pytest.fixture(scope="module")
def url():
    with start_server("miniwob", max_sessions=4) as served:
        yield served


def new_episode(url: str, data_idx: int) -> tuple[int, str]:
    status, created = request_json(url, "POST", "/create", {})
    assert status == 200, created
    status, reset = request_json(url, "POST", "/reset", {"id": created["id"], "data_idx": data_idx})
    assert status == 200, reset
    return created["id"], reset["observation"]


def step(url: str, session: int, action: str) -> dict:
    status, result = request_json(url, "POST", "/step", {"id": session, "action": f"Thought: go.\nAction: {action}"})
    assert status == 200, result
    return result


def ref_of(observation: str, pattern: str) -> str:
    """The ref of the first page line matching `pattern` (a regex over the line after the ref)."""
    for line in observation.splitlines():
        m = re.match(r"\s*\[(\d+)\] (.*)", line)
        if m and re.search(pattern, m[2]):
            return m[1]
    raise AssertionError(f"no line matching {pattern!r} in\n{observation}")


def test_task_ids_pair_names_with_seeds_and_split_by_seed():
    assert len(set(tasks.TASKS)) == len(tasks.TASKS)
    assert [tasks.task(task_id(name, seed)) for name in tasks.TASKS for seed in (0, 7, 49)] == [
        tasks.Task(name, seed) for name in tasks.TASKS for seed in (0, 7, 49)]
    assert {tasks.task(i).name for i in range(len(tasks.TASKS))} == set(tasks.TASKS)  # the first ids span every task
    split = tasks.splits()
    assert sorted(split["train"] + split["test"]) == list(range(tasks.num_tasks()))
    assert {tasks.task(i).seed % tasks.TEST_EVERY for i in split["test"]} == {0}
    assert {tasks.task(i).name for i in split["test"]} == set(tasks.TASKS)  # every task in both splits
    assert set(oracle.SOLVERS) <= set(tasks.TASKS) and len(oracle.SOLVERS) >= 10
    with pytest.raises(ValueError, match="out of range"):
        tasks.task(tasks.num_tasks())
    with pytest.raises(ValueError, match="seeds 0..49"):
        task_id("click-button", 50)


@pytest.mark.parametrize("raw, text", [('"Hello world"', "Hello world"), ("'a b'", "a b"), ("plain words", "plain words"),
                                       ('"say "hi""', 'say "hi"'), ('"', '"')])
def test_type_text_argument(raw, text):
    assert parse_text_argument(raw) == text


def test_a_missing_chromedriver_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIWOB_CHROMEDRIVER", str(tmp_path / "nothing-here"))
    with pytest.raises(FileNotFoundError, match="apt-get install -y chromium chromium-driver"):
        chromedriver_path()


@pytest.mark.parametrize("raw", ["two", "-1", "1.5"])
def test_a_bad_pool_size_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("MINIWOB_POOL_SIZE", raw)
    with pytest.raises(ValueError, match=f"MINIWOB_POOL_SIZE='{re.escape(raw)}' is not valid: want an integer >= 0"):
        env_number("MINIWOB_POOL_SIZE", "2", int, 0)


def test_tasks_metadata_marks_the_oracle_tasks(url):
    status, info = request_json(url, "GET", "/tasks")
    assert status == 200
    meta = info["metadata"]
    assert meta["task_names"] == list(tasks.TASKS) and meta["seeds_per_task"] == tasks.SEEDS_PER_TASK
    assert meta["oracle_tasks"] == sorted(oracle.SOLVERS)
    assert {tasks.task(i).name for i in meta["oracle_task_ids"]} == set(oracle.SOLVERS)
    session, _ = new_episode(url, task_id("click-widget", 0))  # a task without an oracle
    status, answer = request_json(url, "GET", f"/oracle_action?id={session}")
    assert status == 501 and "click-widget" in answer["error"] and "has no oracle" in answer["error"]
    request_json(url, "POST", "/close", {"id": session})


def test_page_text_type_and_submit_with_the_tasks_reward(url):
    session, first = new_episode(url, task_id("login-user", 3))
    user, password = re.search(r'username "(.*)" and the password "(.*)"', first).groups()
    assert first.startswith("Task: Enter the username") and "\nPage:\n" in first
    username_ref, password_ref = ref_of(first, r"^input#username text"), ref_of(first, r"^input#password password")
    result = step(url, session, f'type [{username_ref}] "{user}"')
    assert result["reward"] == 0 and not result["done"] and f'value="{user}"' in result["observation"]
    _, actions = request_json(url, "GET", f"/available_actions?id={session}")
    assert f'type [{username_ref}] "text"' in actions["available_actions"]
    assert f"click [{ref_of(first, 'Login')}]" in actions["available_actions"]
    result = step(url, session, f'type [{password_ref}] "{password}"')
    assert "value=\"" + "*" * len(password) + '"' in result["observation"]  # password fields show stars
    result = step(url, session, f"click [{ref_of(first, 'button#subbtn')}]")
    assert result["done"] and result["reward"] == 1.0 and result["info"]["success"] is True
    assert result["info"]["raw_reward"] == 1.0 and "reward 1" in result["observation"]
    request_json(url, "POST", "/close", {"id": session})


def test_a_wrong_answer_ends_with_the_tasks_negative_reward(url):
    session, first = new_episode(url, task_id("click-button", 0))
    wanted = re.search(r'Click on the "(.*)" button', first)[1]
    wrong = next(m for m in re.finditer(r"\[(\d+)\] button \"(.*)\"", first) if m[2] != wanted)
    result = step(url, session, f"click [{wrong[1]}]")
    assert result["done"] and result["reward"] == -1.0 and result["info"]["success"] is False
    assert result["info"]["score"] == 0.0
    request_json(url, "POST", "/close", {"id": session})


class _SlowImages(http.server.SimpleHTTPRequestHandler):
    """Serves MiniWoB's files, each image half a second late (a page on a busy machine)."""

    def do_GET(self):
        if self.path.endswith(".png"):
            time.sleep(0.5)
        super().do_GET()

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the browser drops image requests it no longer needs when it closes


@contextlib.contextmanager
def slow_image_site():
    root = os.path.dirname(tasks.html_dir())
    server = _QuietServer(("127.0.0.1", 0), functools.partial(_SlowImages, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(tasks.html_dir())}"
    finally:
        server.shutdown()
        server.server_close()


def test_first_observation_shows_icons_whose_images_load_late():
    """The inbox's star and trash icons are images (CSS `content: url(...)`) with no size until
    they load; the episode starts only once they have, so the first page text lists them."""
    browser = Browser()
    try:
        with slow_image_site() as site:
            browser.open(f"{site}/email-inbox.html", tasks.task(task_id("email-inbox", 3)).js_seed, 60_000)
            _, lines = browser.render(120)
    finally:
        browser.close()
    senders = sum(".email-sender" in line for _, line in lines)
    assert senders >= 3
    assert sum("span.star" in line for _, line in lines) == senders
    assert sum("span.trash" in line for _, line in lines) == senders


def test_press_keys_select_options_and_scroll(url):
    session, first = new_episode(url, task_id("enter-text", 5))
    field = ref_of(first, r"^input#tt")
    result = step(url, session, f'type [{field}] "abc"')
    result = step(url, session, f"press [{field}] Backspace")
    assert 'value="ab"' in result["observation"] and "focused" in result["observation"]
    result = step(url, session, f"press [{field}] ctrl+a")
    result = step(url, session, f"press [{field}] x")  # replaces the selection
    assert 'value="x"' in result["observation"]
    for action in ("scroll down", "scroll up"):  # the page itself does not scroll here; still valid
        assert step(url, session, action)["info"]["invalid_action"] is False
    request_json(url, "POST", "/close", {"id": session})

    session, first = new_episode(url, task_id("choose-list", 0))
    wanted = re.search(r"Select (.*) from the list", first)[1]
    option = ref_of(first, '^option "' + re.escape(wanted) + '"')
    result = step(url, session, f"click [{option}]")
    assert f'selected="{wanted}"' in result["observation"]
    request_json(url, "POST", "/close", {"id": session})


@pytest.mark.parametrize("seed", [0, 1])  # seed 0 asks for the bottom, seed 1 for the top
def test_scrolling_an_element_moves_it_and_the_page_text_says_where(url, seed):
    session, observation = new_episode(url, task_id("scroll-text-2", seed))
    end = re.search(r"to the (top|bottom) of the text", observation)[1]
    area = ref_of(observation, r"^textarea#text-area")
    positions = []
    while f"scroll={end}" not in observation and len(positions) < 20:
        positions.append(re.search(r"scroll=(\S+)", observation)[1])
        observation = step(url, session, f"scroll [{area}] {'down' if end == 'bottom' else 'up'}")["observation"]
    assert positions and f"scroll={end}" in observation, positions
    result = step(url, session, f"click [{ref_of(observation, 'button#subbtn')}]")
    assert result["done"] and result["reward"] == 1.0  # the task's own check of the scroll position
    request_json(url, "POST", "/close", {"id": session})


@pytest.mark.parametrize("action, why", [
    ("click [999]", "there is no element [999]"),
    ("press [1] Hyperspace", "unknown key 'Hyperspace'"),
    ("press [1] turbo+a", "cannot read the key"),
    ("drag [1] to [2]", "unknown action"),
    ("click the blue one", "unknown action"),
])
def test_invalid_actions_are_observations_that_say_why(url, action, why):
    session, first = new_episode(url, task_id("enter-text", 0))
    result = step(url, session, action)
    request_json(url, "POST", "/close", {"id": session})
    assert result["info"]["invalid_action"] is True and result["reward"] == 0 and not result["done"]
    assert result["observation"].startswith("Invalid action:") and why in result["observation"]
    assert first.split("\n", 1)[1] in result["observation"]  # the page is shown again


def test_over_long_text_to_type_is_an_invalid_turn_and_the_session_goes_on(url):
    """5000 characters (within the server's reply cap) would take Chromium seconds to type;
    100,000 took 31 s, past the driver's time-out, and broke the session."""
    session, first = new_episode(url, task_id("enter-text", 0))
    field = ref_of(first, r"^input#tt")
    start = time.monotonic()
    result = step(url, session, f'type [{field}] "{"a" * 5000}"')
    assert time.monotonic() - start < 1.0
    assert result["info"]["invalid_action"] is True and result["reward"] == 0 and not result["done"]
    assert "5000 characters long; type at most 1000" in result["observation"]
    assert 'value="abc"' in step(url, session, f'type [{field}] "abc"')["observation"]
    request_json(url, "POST", "/close", {"id": session})


def test_typing_into_a_button_is_invalid(url):
    session, first = new_episode(url, task_id("enter-text", 0))
    result = step(url, session, f'type [{ref_of(first, "button#subbtn")}] "hello"')
    assert result["info"]["invalid_action"] is True and "cannot take it" in result["observation"]
    request_json(url, "POST", "/close", {"id": session})


def test_oracle_solves_one_test_id_of_every_oracle_task(url):
    ids = [task_id(name, 5) for name in sorted(oracle.SOLVERS)]
    solved = asyncio.run(_run_oracle(url, ids, concurrency=2))
    assert all(solved.values()), [tasks.task(i) for i, ok in solved.items() if not ok]


@pytest.mark.slow  # 300 episodes, each with a browser of its own: ~2-3 min on 2 cores
def test_oracle_solves_95_percent_of_the_test_ids_of_every_oracle_task(url):
    test = [i for i in tasks.splits()["test"] if tasks.task(i).name in oracle.SOLVERS]
    solved = asyncio.run(_run_oracle(url, test, concurrency=2))
    for name in oracle.SOLVERS:
        results = [ok for i, ok in solved.items() if tasks.task(i).name == name]
        assert sum(results) >= 0.95 * len(results), (name, results)


def play_oracle(url: str, data_idx: int) -> list:
    session, first = new_episode(url, data_idx)
    trace = [first]
    for _ in range(20):
        _, answer = request_json(url, "GET", f"/oracle_action?id={session}")
        result = step(url, session, answer["action"])
        trace.append((answer["action"], result["observation"], result["reward"], result["done"]))
        if result["done"]:
            break
    request_json(url, "POST", "/close", {"id": session})
    return trace


def test_whole_episodes_are_the_same_in_another_server_process(url):
    ids = [task_id("email-inbox", 10), task_id("navigate-tree", 20), task_id("click-checkboxes", 45)]
    with start_server("miniwob", env_vars={"PYTHONHASHSEED": "7"}) as other:
        assert [play_oracle(other, i) for i in ids] == [play_oracle(url, i) for i in ids]
    pages = []
    for seed in (1, 2):
        session, observation = new_episode(url, task_id("click-link", seed))
        request_json(url, "POST", "/close", {"id": session})
        pages.append(observation)
    assert pages[0] != pages[1]


def _drivers(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children() if p.name() == "chromedriver"}


def test_session_cap_and_idle_reaping_close_browsers():
    with start_server("miniwob", max_sessions=2, idle_timeout_s=8, env_vars={"MINIWOB_POOL_SIZE": "0"}) as url:
        server = server_pid(url)
        first = request_json(url, "POST", "/create", {})[1]["id"]
        assert not _drivers(server)  # a browser starts with the first reset
        new_episode(url, task_id("click-test", 0))
        request_json(url, "POST", "/reset", {"id": first, "data_idx": task_id("click-test", 5)})
        assert len(_drivers(server)) == 2
        status, answer = request_json(url, "POST", "/create", {})
        assert status == 503 and "session cap 2" in answer["error"]
        request_json(url, "POST", "/close", {"id": first})
        assert len(_drivers(server)) == 1
        deadline = time.monotonic() + 60
        while (request_json(url, "GET", "/health")[1]["sessions"] or _drivers(server)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert request_json(url, "GET", "/health")[1]["sessions"] == 0 and not _drivers(server)


def test_env_pool_bounds_live_sessions_and_so_browsers():
    """Without --max_sessions the server caps sessions at what half the machine's memory holds of
    browsers (named in /health); an EnvPool bounded to 2 plays 6 oracle episodes started at once
    with at most 2 sessions open, so the server starts 2 browsers in all (the idle-browser pool
    reuses them), and every episode succeeds."""
    ids = [task_id(name, 5) for name in sorted(oracle.SOLVERS)[:6]]
    with start_server("miniwob") as url:
        health = request_json(url, "GET", "/health")[1]
        browsers = int(re.fullmatch(r"memory: 50% of [\d.]+ GiB holds (\d+) engines of 400 MiB, less 0 kept idle",
                                    health["max_sessions_from"])[1])
        assert health["max_sessions"] == max(1, browsers)
        assert browsers * MiniWoBEnv.session_memory_mb <= 0.5 * psutil.virtual_memory().total / 2**20
        episodes, client, seen = asyncio.run(oracle_episodes_watched(url, ids, max_sessions=2))
        drivers = _drivers(server_pid(url))
    assert [e.status.value for e in episodes] == ["success"] * 6, [(e.data_idx, e.error) for e in episodes]
    assert client.calls["/create"] == 2 and max(seen) <= 2 and len(drivers) == 2


def test_closed_sessions_leave_warm_browsers_for_the_next():
    with start_server("miniwob", env_vars={"MINIWOB_POOL_SIZE": "1"}) as url:
        server = server_pid(url)
        sessions = [new_episode(url, task_id("click-test", 0))[0] for _ in range(2)]
        drivers = _drivers(server)
        for session in sessions:
            request_json(url, "POST", "/close", {"id": session})
        (kept,) = _drivers(server)  # one idle browser stays, the other is closed
        assert kept in drivers
        session, observation = new_episode(url, task_id("click-test", 5))
        assert _drivers(server) == {kept} and observation.startswith("Task: Click the button.")


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_killed_or_hung_browser_ends_its_session_and_the_others_go_on(fault):
    """SIGKILL (a crash) or SIGSTOP (a hang, caught by a 5 s command time-out) of one session's Chromium."""
    with start_server("miniwob", env_vars={"MINIWOB_POOL_SIZE": "0", "MINIWOB_COMMAND_TIMEOUT_S": "5"}) as url:
        _break_a_browser_under_a_session(url, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)


def _break_a_browser_under_a_session(url: str, sig: int) -> None:
    server = server_pid(url)
    victim, _ = new_episode(url, task_id("click-test", 0))
    (driver,) = _drivers(server)
    survivor, first = new_episode(url, task_id("click-test", 5))
    for browser in psutil.Process(driver).children():  # Chromium's main process
        browser.send_signal(sig)
    status, answer = request_json(url, "POST", "/step", {"id": victim, "action": "click [1]"}, timeout_s=60)
    assert status == 500 and "browser is gone or hung" in answer["error"] and "reset or close" in answer["error"]
    assert request_json(url, "GET", f"/observation?id={victim}")[0] == 409  # broken until reset or closed
    result = step(url, survivor, f"click [{ref_of(first, 'button')}]")
    assert result["done"] and result["info"]["success"] is True
    status, reset = request_json(url, "POST", "/reset", {"id": victim, "data_idx": task_id("click-test", 0)})
    assert status == 200 and reset["observation"].startswith("Task: Click the button.")  # a new browser
    for session in (victim, survivor):
        request_json(url, "POST", "/close", {"id": session})


def test_instruction_names_every_action():
    for action in ("click [ref]", 'type [ref] "text"', "press [ref] key", "scroll"):
        assert action in MiniWoBEnv.instruction
