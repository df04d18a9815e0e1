"""The sandbox (`environments/sandbox/`): commands run, files persist, and every escape fails.

Each escape test tries the real thing in a real bubblewrap sandbox and checks from outside
(the host's file system, a real TCP server, the host's process table) that nothing got out.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from environments.sandbox import Limits, RequestFailed, Sandbox, SandboxError, SandboxUnavailable
from tests.servers import REPO

FAST = Limits(cpu_s=2, wall_s=2, processes=32, output_bytes=4096, disk_bytes=4 << 20)


def processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is `uid` (a sandbox's bwrap, its process 1 and its commands)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()
        if int(uids[1]) == uid and "State:\tZ" not in status:
            pids.append(int(pid))
    return pids


def wait_until_gone(uid: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def box():
    with Sandbox(FAST) as sandbox:
        yield sandbox


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the escape tests identify sandboxes by their host uid (root only)")


def test_commands_run_in_the_work_directory_and_files_persist(box):
    first = box.run("pwd; echo hello > note.txt; echo oops >&2; exit 3")
    assert (first.stdout, first.stderr, first.exit_code) == ("/work\n", "oops\n", 3)
    assert not (first.timed_out or first.truncated or first.signal)
    second = box.run("cat note.txt; cat", stdin="from stdin")
    assert second.stdout == "hello\nfrom stdin" and second.exit_code == 0
    box.write({"bin/tool.sh": "#!/bin/bash\necho tool $1\n", "data/a.txt": "a\n"}, executable=["bin/tool.sh"])
    assert box.run("bin/tool.sh x").stdout == "tool x\n"
    assert box.read(["data", "note.txt", "missing"]) == {"data/a.txt": "a\n", "note.txt": "hello\n", "missing": None}
    rendered = first.render(FAST)
    assert rendered == "stdout:\n/work\nstderr:\noops\nexit code: 3"


def test_the_runner_refuses_paths_outside_work_and_keeps_serving(box):
    for path in ("../etc/passwd", "/etc/x", "a/../../x"):
        with pytest.raises(RequestFailed, match="must be relative and stay inside /work"):
            box.write({path: "x"})
    box.run("mkfifo pipe")
    assert box.read(["pipe"]) == {"pipe": None}  # a FIFO is not read (it would block process 1)
    assert box.run("echo still here").stdout == "still here\n"


def test_writing_outside_the_work_directory_fails(box):
    token = secrets.token_hex(6)
    targets = [f"/etc/{token}", f"/usr/{token}", f"/{token}", f"/dev/{token}", f"/sandbox/{token}",
               f"/proc/{token}", "/sandbox/runner.py", "/proc/sys/kernel/hostname", "/etc/passwd"]
    script = "; ".join(f"echo {token} > {t} && echo WROTE {t}" for t in targets)
    result = box.run(script + f"; echo {token} > /tmp/{token} && echo private-tmp")
    assert "WROTE" not in result.stdout, result.stdout
    assert "private-tmp" in result.stdout  # /tmp inside is writable ... but private:
    for host_path in [f"/etc/{token}", f"/usr/{token}", f"/{token}", f"/tmp/{token}", f"/dev/{token}"]:
        assert not os.path.exists(host_path), host_path
    assert token not in pathlib.Path("/etc/passwd").read_text()
    remount = box.run("mount -o remount,rw / && echo REMOUNTED; unshare -U true && echo NEW-USERNS")
    assert "REMOUNTED" not in remount.stdout and "NEW-USERNS" not in remount.stdout


def test_the_network_cannot_be_reached():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = textwrap.dedent(f"""
        import socket
        for host in ("127.0.0.1", "10.0.0.1", "1.1.1.1"):
            try:
                socket.create_connection((host, {port}), timeout=1).close()
                print("CONNECTED", host)
            except OSError as e:
                print("refused", host, type(e).__name__)
    """)
    with Sandbox(FAST) as box:
        result = box.run("python3 -", stdin=probe)
        interfaces = box.run("tail -n +3 /proc/net/dev | cut -d: -f1").stdout.split()
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing reached the server's backlog
        server.accept()
    server.close()
    assert "CONNECTED" not in result.stdout and result.stdout.count("refused") == 3, result
    assert interfaces == ["lo"]


def test_a_fork_bomb_is_contained_and_cleaned_up():
    limits = Limits(cpu_s=3, wall_s=3, processes=24, output_bytes=4096, disk_bytes=1 << 20)
    with Sandbox(limits) as bomb_box, Sandbox(FAST) as neighbour:
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(result=bomb_box.run(":(){ :|:& };:; sleep 30")))
        thread.start()
        peak = 0
        while thread.is_alive():
            peak = max(peak, len(processes_of(bomb_box.host_uid)))
            assert neighbour.run("echo fine").stdout == "fine\n"  # another session keeps working
        thread.join()
        assert limits.processes // 2 < peak <= limits.processes + 1  # it ran into the limit (+ bwrap outside)
        assert outcome["result"].timed_out
        assert len(processes_of(bomb_box.host_uid)) == 2  # bwrap and process 1, nothing else
        assert bomb_box.run("echo recovered").stdout == "recovered\n"


def test_filling_the_disk_stops_at_the_limit(box):
    result = box.run("cat /dev/zero > big; cat /dev/zero > /tmp/big; "
                     "for i in $(seq 3000); do head -c 4096 /dev/zero > small$i || break; done; "
                     "stat -c %s big /tmp/big; du -sb /work | cut -f1")
    big, tmp_big, used = map(int, result.stdout.split())
    assert big <= FAST.disk_bytes and tmp_big <= FAST.disk_bytes and used <= FAST.disk_bytes + (1 << 20)
    assert "No space left on device" in result.stderr or "File too large" in result.stderr
    with pytest.raises(RequestFailed, match="No space left on device"):  # the runner's own write: refused, not broken
        box.write({"more.txt": "x" * 100_000})
    assert box.run("rm -f big small*; echo ok > small").exit_code == 0  # freeing space works


def test_memory_cpu_and_output_limits(box):
    memory = box.run("python3 -c 'x = bytearray(1 << 30)'")
    assert memory.exit_code != 0 and "MemoryError" in memory.stderr
    spin_limits = Limits(cpu_s=1, wall_s=20, processes=8, output_bytes=4096, disk_bytes=1 << 20)
    with Sandbox(spin_limits) as spin_box:
        spin = spin_box.run("while :; do :; done")
    assert spin.signal in ("SIGXCPU", "SIGKILL") and not spin.timed_out and spin.wall_s < 15
    chatty = box.run("yes")
    assert chatty.truncated and len(chatty.stdout) <= FAST.output_bytes and chatty.exit_code == 137
    assert "(output truncated: stopped after 4096 bytes of output)" in chatty.render(FAST)


def test_sleeping_forever_is_killed_at_the_wall_limit_with_everything_it_started(box):
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    start = time.monotonic()
    result = box.run(f"(setsid nohup sleep {marker} &); sleep infinity")
    assert result.timed_out and result.signal == "SIGKILL" and time.monotonic() - start < FAST.wall_s + 5
    assert "(stopped after the 2 s time limit)" in result.render(FAST)
    background = box.run(f"nohup sleep {marker} > /dev/null 2>&1 & disown; echo started")
    assert background.stdout == "started\n" and not background.timed_out  # it returns at once ...
    assert len(processes_of(box.host_uid)) == 2  # ... and its background process is gone
    assert box.run("ps -e -o comm=").stdout.split() == ["python3", "ps"]


def test_another_sessions_files_cannot_be_read():
    secret = secrets.token_hex(8)
    with Sandbox(FAST) as owner, Sandbox(FAST) as other:
        owner.write({"secret.txt": secret})
        owner.run(f"echo {secret} > /tmp/secret.txt")
        probe = other.run("ls /work /tmp; cat /proc/*/root/work/secret.txt /proc/*/root/tmp/secret.txt; "
                          "find / -xdev -name secret.txt 2>/dev/null; ps -e -o pid=,comm=")
        assert secret not in probe.stdout + probe.stderr
        assert owner.run("cat secret.txt").stdout == secret  # it is there, in its own session
        assert [line.split()[1] for line in probe.stdout.splitlines()[-2:]] == ["python3", "ps"]


def test_close_kills_a_running_command_and_leaves_no_process():
    box = Sandbox(dataclasses.replace(FAST, wall_s=30))
    uid = box.host_uid
    errors: list[Exception] = []

    def run_long() -> None:
        try:
            box.run("sleep 1000 & sleep 1000")
        except SandboxError as e:
            errors.append(e)

    thread = threading.Thread(target=run_long)
    thread.start()
    deadline = time.monotonic() + 10
    while len(processes_of(uid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    box.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert [str(e) for e in errors] == ["the sandbox was closed"]
    assert wait_until_gone(uid) == []
    with pytest.raises(SandboxError, match="closed"):
        box.run("echo too late")


def test_the_sandbox_ends_when_its_host_process_dies():
    script = textwrap.dedent("""
        import sys
        from environments.sandbox import Limits, Sandbox
        box = Sandbox(Limits(wall_s=60, disk_bytes=1 << 20))
        print(box.host_uid, flush=True)
        box.run("sleep 1000 & sleep 1000")
    """)
    host = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    uid = int(host.stdout.readline())
    deadline = time.monotonic() + 10
    while len(processes_of(uid)) < 4 and time.monotonic() < deadline:  # bwrap, process 1, the sleeps
        time.sleep(0.05)
    assert len(processes_of(uid)) >= 4
    host.send_signal(signal.SIGKILL)
    host.wait()
    assert wait_until_gone(uid) == []


def test_hidden_paths_are_covered():
    with Sandbox(FAST, hidden_paths=["/etc/passwd", "/usr/share", "/root/not-mounted"]) as box:
        passwd = box.run("cat /etc/passwd")
        listed = box.run("ls /usr/share | wc -l; ls /usr/bin | grep -c .")
    assert passwd.exit_code != 0 and "root:" not in passwd.stdout  # a hidden file cannot be opened
    share, bins = map(int, listed.stdout.split())
    assert share == 0 and bins > 10  # a hidden directory is empty; the rest is there


def test_a_missing_bwrap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(`bwrap`\) is not installed: install it with "
                                                 r"`apt-get install -y bubblewrap`"):
        Sandbox(FAST)
