"""What an agent's own commands and files cause is a failed turn or a failed episode, never an
infrastructure error, with the servers run as root and as an unprivileged uid.

Each case is an episode played through `EnvPool` against real `bash` and `code` servers, its
recorded status checked: a real-time signal, a tree of 1,200 nested folders or 300,000
long-named files before `submit`, a FIFO or a link to process 1's own channel where the host
writes, a killed process 1. Before issue 45 these were HTTP 500s (`infra_error`, which RL drops
and evaluation retries), a runner blocked for 10 s, or, under an unprivileged server, the
agent's file read by process 1 as its next request. A flood of a million files meanwhile is
stopped by the inode caps while `/health` keeps answering, and the escape attempts of
`tests/test_sandbox.py` that matter most fail through both servers.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import signal
import socket

import pytest

from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from tests.servers import health_latencies, request_json, start_server

UNPRIVILEGED_UID = 40_000 + os.getpid() % 20_000  # no account has it; one per test run
RENAME, FIX_SCRIPT, QUESTION = 20, 15, 25  # bash test-split tasks: rename_extension, fix_script, count_errors
TRUNCATE = 2  # HumanEval/2
CANONICAL = ("def truncate_number(number: float) -> float:\n    return number % 1.0\n")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts servers as root and as another uid")


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def urls(request):
    uid = UNPRIVILEGED_UID if request.param == "unprivileged" else None
    with start_server("bash", uid=uid) as bash_url, start_server("code", uid=uid) as code_url:
        yield {"bash": bash_url, "code": code_url}


def _write(code: str) -> str:
    return f"write\n```python\n{code}\n```"


def kill_process_1(token: str) -> str:
    """SIGKILLs process 1 of the sandbox whose /work/marker holds `token`; the next action."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (pathlib.Path(f"/proc/{pid}/root/work/marker").read_text().strip() == token
                    and b"runner.py" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()):
                os.kill(int(pid), signal.SIGKILL)
                return "ls"
        except OSError:
            continue
    raise AssertionError("no sandbox holds the marker")


TOKEN = secrets.token_hex(8)
NESTED = "mkdir -p notes/$(printf 'd/%.0s' $(seq 1200))"
LONG_NAMES = ("python3 -c \"import os\nfor i in range(300000):\n"
              "    open('notes/' + 'n' * 200 + str(i), 'w').close()\"")
CASES = {  # name -> (env, task, actions, final status, a text one of the observations holds)
    "a real-time signal": ("bash", QUESTION, ["kill -40 $$", "submit 0"], EpisodeStatus.FAILURE, "(killed by SIG40)"),
    "1,200 nested folders before submit": ("bash", RENAME, [NESTED, "submit"], EpisodeStatus.FAILURE, "not correct"),
    "300,000 long-named files before submit": ("bash", RENAME, [LONG_NAMES, "submit"], EpisodeStatus.FAILURE,
                                               "No space left on device"),
    "a FIFO where the hidden data goes": ("bash", FIX_SCRIPT, ["rm data/sales.csv && mkfifo data/sales.csv", "submit"],
                                          EpisodeStatus.FAILURE, "not correct"),
    "links to process 1's channel where the host writes": (
        "bash", FIX_SCRIPT, ["ln -sf /proc/self/fd/0 data/sales.csv && ln -sf /proc/self/fd/1 data/more.csv", "submit"],
        EpisodeStatus.FAILURE, "not correct"),
    "a killed process 1": ("bash", QUESTION, [f"echo {TOKEN} > marker", lambda: kill_process_1(TOKEN), "submit 0"],
                           EpisodeStatus.FAILURE, "The sandbox stopped"),
    "a solution that sends itself a real-time signal": (
        "code", TRUNCATE, [_write("import os\nos.kill(os.getpid(), 40)"), "run", "submit"], EpisodeStatus.FAILURE,
        "(killed by SIG40)"),
    "solution.py a link to process 1's channel, then a request written to it": (
        "code", TRUNCATE, [_write("import os\nos.remove('solution.py')\nos.symlink('/proc/self/fd/0', 'solution.py')"), "run",
                           _write('{"op": "run", "command": "sleep 1000 & echo 3 of 3 public tests passed", "stdin": ""}'),
                           "run", "submit"], EpisodeStatus.FAILURE, "0 of 3 public tests passed"),
    "solution.py made a FIFO, then a correct solution": (
        "code", TRUNCATE, [_write("import os\nos.remove('solution.py')\nos.mkfifo('solution.py')"), "run",
                           _write(CANONICAL), "run", "submit"], EpisodeStatus.SUCCESS, "3 of 3 public tests passed"),
}


def _scripted(actions: list):
    """A policy that plays `actions` in order (a callable is called for its action)."""
    queue = list(actions)

    async def policy(slot: int, observation: str) -> str:
        action = queue.pop(0)
        return action() if callable(action) else action

    return policy


@pytest.mark.parametrize("case", list(CASES))
def test_agent_faults_are_scored_episodes(urls, case):
    env, task, actions, status, shown = CASES[case]

    async def play():
        async with EnvPool(urls[env], request_timeout_s=60) as pool:
            return await pool.run_episode(task, _scripted(actions), horizon=len(actions))

    episode = asyncio.run(play())
    assert episode.status is status and episode.error is None, (episode.status, episode.error)
    observations = [turn.observation for turn in episode.turns]
    assert any(shown in o for o in observations), observations
    if status is EpisodeStatus.FAILURE:
        assert episode.reward == 0


def test_a_million_file_flood_is_stopped_while_health_answers(urls):
    url = urls["bash"]
    session = request_json(url, "POST", "/create", {})[1]["id"]
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": RENAME})[0] == 200
    flood = ("for d in /work /tmp /dev/shm; do python3 -c \"import os, sys\nmade = 0\ntry:\n"
             "    while made < 1000000:\n        os.symlink('x', f'{sys.argv[1]}/{made:0200d}')\n        made += 1\n"
             "except OSError as e:\n    print(made, e.strerror)\" $d; done")
    with health_latencies(url) as health_s:
        status, result = request_json(url, "POST", "/step", {"id": session, "action": flood})
    assert status == 200, result
    counts = [line.split(" ", 1) for line in result["observation"].splitlines()[1:4]]
    assert [reason for _, reason in counts] == ["No space left on device"] * 3, result["observation"]
    assert all(int(made) <= 16384 for made, _ in counts)
    assert sorted(health_s)[int(0.9 * len(health_s))] < 0.1 and max(health_s) < 1.0, sorted(health_s)[-5:]
    done = request_json(url, "POST", "/step", {"id": session, "action": "submit"})[1]
    assert done["done"] and done["reward"] == 0 and done["info"]["success"] is False
    request_json(url, "POST", "/close", {"id": session})


def test_escapes_fail_through_the_server(urls):
    """The sandbox's walls hold the same under a root and an unprivileged server: no host file
    written, no connection to the host, process 1's fds and memory out of reach, no mount, no
    new user namespace, no tracing."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    token = secrets.token_hex(6)
    probes = {
        "host file": f"echo {token} > /tmp/{token}; echo {token} > /etc/{token} || true",
        "host network": f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=1)'",
        "process 1's channel": "echo '{\"op\": \"run\"}' > /proc/1/fd/0",
        "process 1's memory": "head -c 16 /proc/1/mem",
        "process 1's root": "ls /proc/1/root/",
        "a mount": "mount -t tmpfs none /work",
        "a user namespace": "unshare -Ur true",
        "tracing": "python3 -c 'import ctypes; assert ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0'",
    }
    session = request_json(urls["bash"], "POST", "/create", {})[1]["id"]
    assert request_json(urls["bash"], "POST", "/reset", {"id": session, "data_idx": QUESTION})[0] == 200
    for name, command in probes.items():
        status, result = request_json(urls["bash"], "POST", "/step", {"id": session, "action": f"{command} && echo ESCAPED"})
        assert status == 200, (name, result)
        assert "ESCAPED" not in result["observation"] or name == "host file", (name, result)  # /tmp is private
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing reached the host's listener
        listener.accept()
    listener.close()
    assert not os.path.exists(f"/tmp/{token}") and not os.path.exists(f"/etc/{token}")
    request_json(urls["bash"], "POST", "/close", {"id": session})
