"""The bash environment: generated tasks, the oracle on every task id, what a wrong submission
gets, the observation format, and a real server whose `/close` leaves no process behind. The
shared endpoint/bad-input/determinism tests run it too (`tests/test_environments.py`)."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import pathlib
import random
import secrets
import time

import pytest

from environments.bash import tasks
from environments.bash.env import MAX_TURNS, BashEnv, normal_answer
from environments.sandbox.actions import code_action
from tests.servers import request_json, start_server
from tests.test_sandbox import processes_of, wait_until_gone


@pytest.fixture(scope="module")
def url():
    with start_server("bash") as base:
        yield base


def _first_of_each_template() -> dict[str, int]:
    ids: dict[str, int] = {}
    for task_id, task in enumerate(tasks.all_tasks()):
        ids.setdefault(task.template, task_id)
    return ids


def _play(env: BashEnv, actions: list[str]):
    for action in actions:
        result = env.step(action)
    return result


def test_test_split_holds_every_template_equally():
    info = BashEnv.task_info()
    test = [tasks.all_tasks()[i].template for i in info.splits["test"]]
    assert collections.Counter(test) == {t.__name__: tasks.PER_TEMPLATE // 5 for t in tasks.TEMPLATES}


def test_the_oracle_solves_every_task_and_its_commands_find_the_answers():
    def play(task_id: int) -> tuple[bool, list[str]]:
        env = BashEnv()
        try:
            env.reset(task_id)
            observations = []
            while True:
                result = env.step(env.oracle_action())
                observations.append(result.observation)
                if result.done:
                    return result.info["success"] and result.reward == 1.0, observations
        finally:
            env.close()

    all_tasks = tasks.all_tasks()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        played = list(pool.map(play, range(len(all_tasks))))
    assert [i for i, (ok, _) in enumerate(played) if not ok] == []
    for task, (_, observations) in zip(all_tasks, played):
        if task.answer is not None:  # the shell command printed what the oracle submits
            assert task.answer in observations[0], (task.template, observations[0])


def test_wrong_submissions_fail():
    ids = _first_of_each_template()
    wrong = {
        "find_token": ["submit docs/nowhere.txt"],
        "count_errors": ["submit 1000"],
        "count_files": ["submit 1000"],
        "largest_file": ["submit backup/big.txt"],
        "rename_extension": ["cd notes && f=$(ls *.txt | head -n 1) && mv $f ${f%.txt}.md", "submit"],  # one of several
        "replace_identifier": ["submit"],  # nothing changed
        "sort_unique": ["sort data/names.txt > data/unique_names.txt", "submit"],  # repeats kept
        "fix_script": None,  # filled below: prints the visible total, which the hidden data does not have
    }
    env = BashEnv()
    env.reset(ids["fix_script"])
    visible_total = env.sandbox.run("awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == \"amount\") c = i } "
                                    "NR > 1 { t += $c } END { print t }' data/sales.csv").stdout.strip()
    wrong["fix_script"] = [f"printf '#!/bin/bash\\necho {visible_total}\\n' > bin/total.sh", "bash bin/total.sh", "submit"]
    assert env.step(wrong["fix_script"][0]).info["exit_code"] == 0
    assert env.step(wrong["fix_script"][1]).observation.startswith(f"stdout:\n{visible_total}\n")
    assert env.step("submit").reward == 0.0 and not env.verify()
    env.close()
    for template, actions in wrong.items():
        if template == "fix_script":
            continue
        env = BashEnv()
        env.reset(ids[template])
        result = _play(env, actions)
        assert result.done and result.reward == 0.0 and result.info["success"] is False, template
        assert result.observation == "Your submission is not correct. The task is over."
        env.close()


def test_answers_compare_after_normalising():
    assert normal_answer(" ./docs/a.txt ") == normal_answer("/work/docs/a.txt") == "docs/a.txt"
    assert normal_answer("`42`.") == normal_answer("042") == "42"
    assert normal_answer("'notes/x.md'") == "notes/x.md"
    assert normal_answer("docs/a.txt") != normal_answer("docs/b.txt")


def test_actions_are_read_from_the_reply():
    assert code_action("Thought: look.\nAction: ls -la") == "ls -la"
    assert code_action("Thought: Action: is a word.\nAction:\n```bash\ncat > f <<'EOF'\na\nEOF\n```") == \
        "cat > f <<'EOF'\na\nEOF"
    assert code_action("Action: `wc -l data/names.txt`") == "wc -l data/names.txt"
    assert code_action("echo no marker") == "echo no marker"
    assert code_action("Thought: nothing.\nAction:   ") is None
    # a marker inside a fenced block is part of the code (it used to cut the action there)
    fenced = "Thought: log it.\nAction:\n```bash\necho 'Action: done' >> log.txt\ncat log.txt\n```"
    assert code_action(fenced) == "echo 'Action: done' >> log.txt\ncat log.txt"
    assert code_action("```bash\necho Action: one\n```") == "echo Action: one"
    assert code_action("Action: ls\n```\nAction: inside an unclosed fence") == "ls\n```\nAction: inside an unclosed fence"


def test_observations_show_stdout_stderr_exit_code_and_limits(url):
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": _first_of_each_template()["count_errors"]})
    assert status == 200 and reset["observation"].startswith("Task: How many lines with the level ERROR")

    def step(action: str) -> dict:
        status, body = request_json(url, "POST", "/step", {"id": session, "action": f"Thought: try.\nAction: {action}"})
        assert status == 200, body
        return body

    ran = step("echo out; echo err >&2; exit 2")
    assert ran["observation"] == "stdout:\nout\nstderr:\nerr\nexit code: 2"
    assert ran["info"]["exit_code"] == 2 and ran["info"]["invalid_action"] is False and ran["reward"] == 0
    assert step("true")["observation"] == "(no output)\nexit code: 0"
    flood = step("yes")
    assert flood["info"]["truncated"] and flood["observation"].endswith(
        "(output truncated: stopped after 4096 bytes of output)\nexit code: 137")
    missing = step("frobnicate --all")
    assert missing["info"]["invalid_action"] is True and "command not found" in missing["observation"]
    garbled = step("oak planks) craft (")
    assert garbled["info"]["invalid_action"] is True and "syntax error" in garbled["observation"]
    assert step("ls no-such-dir")["info"]["invalid_action"] is False  # exit code 2, but a command that ran
    empty_answer = step("submit")
    assert empty_answer["info"]["invalid_action"] is True and empty_answer["done"] is False
    assert "submit <answer>" in empty_answer["observation"]
    for _ in range(MAX_TURNS - 7):
        last = step("ls logs > /dev/null")
    assert last["done"] is True and last["reward"] == 0 and "used all 20 turns" in last["observation"]
    assert request_json(url, "POST", "/step", {"id": session, "action": "ls"})[0] == 409
    request_json(url, "POST", "/close", {"id": session})


def _sandbox_uid_holding(marker_path: str, token: str) -> int:
    """The host uid of the sandbox whose /work holds `marker_path` with `token` (seen via /proc/<pid>/root)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if pathlib.Path(f"/proc/{pid}/root/work/{marker_path}").read_text().strip() == token:
                    return os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError("no sandbox holds the marker")


def test_close_leaves_no_process_behind(url):
    token = secrets.token_hex(8)
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    request_json(url, "POST", "/reset", {"id": session, "data_idx": 0})
    status, result = request_json(url, "POST", "/step", {"id": session, "action": f"echo {token} > marker; (setsid sleep 1000 &); nohup sleep 1000 >/dev/null 2>&1 &"})
    assert status == 200 and result["info"]["exit_code"] == 0
    uid = _sandbox_uid_holding("marker", token)
    assert len(processes_of(uid)) == 2  # bwrap and process 1: the sleeps ended with their command
    assert request_json(url, "POST", "/close", {"id": session}) == (200, {"id": session, "closed": True})
    assert wait_until_gone(uid) == []


HOSTILE_COMMANDS = (
    "rm -rf /work/* /work/.[!.]* /tmp/*", "kill -9 -1", "kill -9 1", "kill -STOP 1", "cat /dev/urandom",
    "yes | head -c 1000000", "exec 1>&- 2>&-; echo gone", "ulimit -n 3; ls", "printf '\\x00\\xff\\xfe'",
    "echo $((1/0))", "ls -l /proc/1/fd", "cat /proc/1/environ", "python3 -c 'import os; os.kill(1, 9)'",
    "unset PATH; ls", "rm -rf /etc /sandbox /bin 2>/dev/null; echo done", "submit", "submit ../../etc/passwd",
    "'unterminated", "$(", "`", "\n\n\nls", "exit 255", "trap '' TERM HUP; sleep 0.2 & disown", "mkfifo p; cat p &",
    "dd if=/dev/zero of=big bs=1M count=100", "python3 -c 'x = \"a\" * 10**10'", "ln -s /etc/passwd logs",
    "chmod 000 .; ls", "for i in $(seq 50); do (sleep 0.1 &); done", "\u00e9\u0000\ufffd\U0001F600",
)


def test_fuzzed_commands_never_break_a_session(url):
    """Seeded sequences of hostile commands: every answer is an ordinary turn, the session keeps
    working, and the oracle still solves the task from a fresh reset."""
    rng = random.Random("fuzz:bash")
    task_id = BashEnv.task_info().splits["test"][1]
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
    for _ in range(40):
        command = rng.choice(["; ", " && ", "\n", " | "]).join(rng.sample(HOSTILE_COMMANDS, rng.randint(1, 3)))
        status, result = request_json(url, "POST", "/step", {"id": session, "action": f"Action: {command}"})
        if status == 409:  # the fuzz submitted: start again
            assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
            continue
        assert status == 200, (command, result)
        assert result["observation"] and result["reward"] == 0 and {"exit_code", "invalid_action"} <= set(result["info"]) \
            or result["done"], (command, result)
        json.dumps(result, allow_nan=False)
        if result["done"]:
            assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})[0] == 200
    while True:
        action = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
        status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
        assert status == 200, result
        if result["done"]:
            break
    assert result["info"]["success"] is True
    request_json(url, "POST", "/close", {"id": session})
