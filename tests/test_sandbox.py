"""The sandbox (`environments/sandbox/`): commands run, files persist, and every escape fails.

Each escape test tries the real thing in a real bubblewrap sandbox and checks from outside
(the host's file system, a real TCP server, the host's process table) that nothing got out.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
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

from environments.sandbox import Limits, RequestFailed, Sandbox, SandboxError, SandboxUnavailable, cgroups, seccomp
from environments.sandbox import sandbox as sandbox_module
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


def test_paths_outside_work_are_refused_and_the_sandbox_keeps_serving(box):
    for path in ("../etc/passwd", "/etc/x", "a/../../x"):
        with pytest.raises(RequestFailed, match="must be relative and stay inside /work"):
            box.write({path: "x"})
    box.run("mkfifo pipe")
    assert box.read(["pipe"]) == {"pipe": None}  # a FIFO is not read (it would block)
    assert box.run("echo still here").stdout == "still here\n"


def test_writes_replace_links_and_fifos_and_never_follow_them(box):
    """The host writes a sandbox's files; a link in a file's place is replaced, a link among its
    folders refuses the write, and reads see links and FIFOs as no file at all."""
    box.run("ln -s /proc/self/fd/0 channel; ln -s /etc/passwd passwd; mkfifo fifo; (cat fifo > /dev/null &); "
            "ln -s /etc linked; mkdir -p real/dir; ln -s real/dir dirlink; echo kept > real/dir/k")
    assert box.read(["channel", "passwd", "fifo", "linked", "dirlink"]) == dict.fromkeys(
        ["channel", "passwd", "fifo", "linked", "dirlink"])
    assert box.read(["real"]) == {"real/dir/k": "kept\n"}  # a tree's links are not followed either
    box.write({"channel": '{"op": "run", "command": "sleep 1000 &"}\n', "passwd": "mine\n", "fifo": "data\n"})
    kinds = box.run("stat -c '%n %F' channel passwd fifo; cat passwd; grep -c '^root:' /etc/passwd").stdout
    assert kinds == "channel regular file\npasswd regular file\nfifo regular file\nmine\n1\n"
    assert box.read(["channel"]) == {"channel": '{"op": "run", "command": "sleep 1000 &"}\n'}
    for path in ("linked/x", "dirlink/x"):
        with pytest.raises(RequestFailed, match=f"cannot reach the folder of {path}"):
            box.write({path: "x"})
    with pytest.raises(RequestFailed, match="cannot write real"):
        box.write({"real": "a directory stays"})
    assert len(processes_of(box.host_uid)) == 2  # no request reached process 1: no sleep runs
    assert box.run("echo alive").stdout == "alive\n"


def test_signals_without_a_name_and_hostile_trees_are_ordinary_answers(box):
    killed = box.run("kill -40 $$")
    assert (killed.signal, killed.exit_code) == ("SIG40", 168) and "(killed by SIG40)" in killed.render(FAST)
    box.run("mkdir -p deep/$(printf 'd/%.0s' $(seq 1200)); mkdir wide && cd wide && seq 5000 | xargs touch")
    start = time.monotonic()
    with pytest.raises(RequestFailed, match="deeper than 32 levels"):
        box.read(["deep"])
    with pytest.raises(RequestFailed, match="more than 4096 files and directories"):
        box.read(["wide"])
    assert time.monotonic() - start < 2
    assert box.run("echo alive").stdout == "alive\n"


def test_process_1_answers_any_request(box):
    """A request it cannot do (here not even JSON) is an error answer; the sandbox keeps serving."""
    box._channel.sendall(b"not json\n")
    assert box._answer(time.monotonic() + 5)["error"].startswith("JSONDecodeError")
    assert box.run("echo alive").stdout == "alive\n"


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


@pytest.mark.parametrize("memory_mb, processes, budget_mb", [(512, 64, 1024), (1024, 16, 1024), (96, 16, 256), (64, 8, 4096)])
def test_without_a_cgroup_processes_times_memory_fits_the_session_budget(memory_mb, processes, budget_mb):
    limits = Limits(memory_bytes=memory_mb << 20, processes=processes, session_memory_bytes=budget_mb << 20)
    fallback = limits.per_process()
    assert fallback.processes * fallback.memory_bytes <= limits.session_memory_bytes
    assert fallback.memory_bytes <= limits.memory_bytes and 2 <= fallback.processes <= limits.processes
    assert fallback.memory_bytes >= min(limits.memory_bytes, 64 << 20)  # enough for python3


def test_the_server_says_once_how_sessions_are_held(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "plan", lambda: "cgroup v1: cannot make cgroups in /x: Permission denied")
    sandbox_module.announce.cache_clear()
    limits = Limits(memory_bytes=512 << 20, processes=64, session_memory_bytes=1 << 30)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            sandbox_module.announce(limits)
    assert [r.getMessage() for r in caplog.records] == [
        "sandbox: no cgroup per sandbox (cgroup v1: cannot make cgroups in /x: Permission denied); per-process "
        "limits instead: 16 processes x 64 MiB; " + ("a seccomp filter" if seccomp.program() else
                                                      f"no seccomp filter (no syscall table for {os.uname().machine})")]
    sandbox_module.announce.cache_clear()


def test_a_missing_bwrap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(`bwrap`\) is not installed: install it with "
                                                 r"`apt-get install -y bubblewrap`"):
        Sandbox(FAST)


def anonymous_bytes(uid: int) -> int:
    """Anonymous memory of every host process of `uid` together: each one's proportional share
    (pages it shares with its forked siblings counted once over all of them)."""
    total = 0
    for pid in processes_of(uid):
        with contextlib.suppress(OSError, StopIteration):
            rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text()
            total += int(next(line for line in rollup.splitlines() if line.startswith("Pss_Anon:")).split()[1]) << 10
    return total


HOGS = textwrap.dedent("""
    import os, time
    for _ in range(8):  # eight processes of 40 MiB each, each under the per-process limit
        try:
            pid = os.fork()
        except OSError:  # the process limit
            break
        if pid == 0:
            try:
                hog = bytearray(40 << 20)
                for i in range(0, len(hog), 4096):
                    hog[i] = 1
                time.sleep(1.5)
            finally:
                os._exit(0)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
""")


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "per-process fallback"])
def test_many_processes_under_the_per_process_limit_stay_within_the_session_budget(cgroup, monkeypatch):
    """320 MiB asked for by eight processes of 40 MiB (each allowed 96 MiB) against a session
    budget of 256 MiB: the cgroup holds the whole; without one, the per-process limits are sized
    so that processes x memory fits the budget."""
    if not cgroup:
        monkeypatch.setattr(cgroups, "plan", lambda: "disabled by the test")
    elif not isinstance(cgroups.plan(), cgroups.Plan):
        pytest.skip(f"no cgroup here: {cgroups.plan()}")
    budget = 256 << 20
    limits = Limits(cpu_s=5, wall_s=5, memory_bytes=96 << 20, processes=16, output_bytes=4096, disk_bytes=1 << 20,
                    session_memory_bytes=budget)
    with Sandbox(limits) as box:
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(result=box.run("python3 -", stdin=HOGS)))
        thread.start()
        peak = 0
        while thread.is_alive():
            peak = max(peak, anonymous_bytes(box.host_uid))
            time.sleep(0.02)
        thread.join()
        assert peak > 64 << 20, peak  # the hogs ran ...
        # ... within the budget (and the 16 MiB that bwrap, outside, and process 1 had before it
        # joined the group hold, which the group does not count), far from the 360 MiB asked for
        assert peak <= budget + (16 << 20), f"{peak >> 20} MiB in use, budget {budget >> 20} MiB"
        assert box.run("echo alive").stdout == "alive\n"


FLOOD = textwrap.dedent("""
    import os, sys
    made = 0
    try:
        while made < 1_000_000:
            os.symlink("x", f"{sys.argv[1]}/{made:0200d}")  # a long name, an inline target: no data blocks
            made += 1
    except OSError as e:
        print(made, e.strerror)
""")


def test_a_million_file_flood_is_stopped_by_the_inode_caps(box):
    start = time.monotonic()
    result = box.run(f"for d in /work /tmp /dev/shm; do python3 -c '{FLOOD}' $d; done")
    lines = result.stdout.splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["No space left on device"] * 3, result
    assert all(int(line.split()[0]) < FAST.inodes for line in lines) and time.monotonic() - start < 10
    assert box.run("find /work /tmp -mindepth 1 -delete; echo ok > /work/a && cat /work/a").stdout == "ok\n"


def test_the_kernel_memory_of_a_file_flood_counts_against_the_session():
    """With the inode cap out of the way, the cgroup stops the flood: the kernel memory of tmpfs
    inodes and dentries is charged to the session that made them."""
    if not isinstance(cgroups.plan(), cgroups.Plan):
        pytest.skip(f"no cgroup here: {cgroups.plan()}")
    limits = dataclasses.replace(FAST, wall_s=20, inodes=2_000_000, session_memory_bytes=64 << 20)
    with Sandbox(limits) as box:
        result = box.run(f"python3 -c '{FLOOD}' /work; ls -f /work | wc -l")
        made = int(result.stdout.split()[-1])
        assert 1000 < made < 200_000, result
        assert box.run("find /work -mindepth 1 -delete; echo ok > /work/a && cat /work/a").stdout == "ok\n"


def test_the_session_shares_its_cpu_bandwidth():
    """Two busy processes of a sandbox held to half a CPU get half a CPU-second a second together
    (three quarters of a second in 1.5 s, where they would take three on two idle cores)."""
    if not isinstance(cgroups.plan(), cgroups.Plan) or "cpu" not in cgroups.plan().controllers:
        pytest.skip("no cpu cgroup here")
    spin = "import os, time\nfor _ in range(2):\n    if os.fork() == 0:\n        end = time.monotonic() + 1.5\n" \
           "        while time.monotonic() < end:\n            pass\n        os._exit(0)\nos.wait(); os.wait()\n" \
           "print(sum(os.times()[2:4]))"
    with Sandbox(dataclasses.replace(FAST, wall_s=10, cpu_s=10, cpus=0.5)) as box:
        used = float(box.run("python3 -", stdin=spin).stdout)
    assert used < 0.5 * 1.5 + 0.3, used


def test_the_seccomp_filter_matches_the_kernels_syscall_numbers():
    """Our tables against libseccomp's, where the library is installed."""
    try:
        library = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("libseccomp is not installed")
    library.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    names = {**seccomp.REFUSED, "clone": seccomp.CLONE, "unshare": seccomp.UNSHARE, "clone3": seccomp.CLONE3}
    for index, (machine, arch) in enumerate(seccomp.AUDIT_ARCH.items()):
        for name, numbers in names.items():
            assert library.seccomp_syscall_resolve_name_arch(arch, name.encode()) == numbers[index], (machine, name)


SYSCALLS = textwrap.dedent("""
    import ctypes, os, threading
    libc = ctypes.CDLL(None, use_errno=True)
    def errno_of(number, *args):
        ctypes.set_errno(0)
        libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
        return ctypes.get_errno()
    for name, number, args in CALLS:
        print(name, errno_of(number, *args))
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    thread = threading.Thread(target=lambda: None)
    thread.start(); thread.join()
    print("fork and threads", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""")


def test_the_syscalls_an_agent_never_needs_fail():
    if seccomp.program() is None:
        pytest.skip(f"no syscall table for {os.uname().machine}")
    which = tuple(seccomp.AUDIT_ARCH).index(os.uname().machine)
    calls = [(name, numbers[which], ()) for name, numbers in seccomp.REFUSED.items()]
    calls += [("unshare a user namespace", seccomp.UNSHARE[which], (seccomp.CLONE_NEWUSER,)),
              ("clone3", seccomp.CLONE3[which], (0, 0))]
    with Sandbox(FAST) as box:
        result = box.run("python3 -", stdin=f"CALLS = {calls!r}\n{SYSCALLS}")
        namespaces = box.run("unshare -U true && echo NEW-USERNS; unshare -r true && echo ROOT")
    errnos = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert errnos.pop("fork and threads") == "7"
    assert errnos.pop("clone3") == str(errno.ENOSYS)  # so that libc falls back to clone, which the filter can read
    assert errnos == {name: str(errno.EPERM) for name, _, _ in calls if name != "clone3"}, result
    assert "NEW-USERNS" not in namespaces.stdout and "ROOT" not in namespaces.stdout
