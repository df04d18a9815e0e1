"""One bubblewrap sandbox per session, for every environment that runs model-written code.

A `Sandbox` is a long-lived `bwrap` process holding new user, pid, mount, network, IPC, UTS and
cgroup namespaces. Inside, the system (`/usr`, `/etc`) is mounted read-only, the root and
`/dev` are read-only, `/work` (the session's work directory, also `$HOME`), `/tmp` and
`/dev/shm` are private tmpfs mounts of `disk_bytes` and `inodes` each, and there is no network
but an empty loopback. Process 1 inside is `runner.py`: it finishes the sandbox (the mounts, a
nested user namespace where it is uid 1000 without any capability, the seccomp filter of
`seccomp.py`), then runs each command as `bash -c` in `/work` with CPU-time, address-space,
process-count, file-size and open-file rlimits, stops it at the wall-time or output limit, and
kills every process the command left. The session as a whole is held by its cgroup
(`cgroups.py`: memory with kernel memory, processes, CPU); where the host has none to give,
per-process limits sized to the session's budget stand in (`Limits.per_process`).

Files are read and written by the host, never by process 1, through `/proc/<process 1>/root/work`
without following any link (`files.py`). Files persist between commands of a session;
processes, the working directory and shell variables do not.

Run as root (a container), each sandbox also gets its own unprivileged host uid, so nothing in
it is uid 0 anywhere; run as any other uid, the sandbox is that uid on the host, with nothing of
the runner's channel reachable from inside. `close()` kills process 1, which ends every process
in the namespace; the runner also leaves when the host process dies (its socket closes).
Install bubblewrap with `apt-get install -y bubblewrap`; without it `Sandbox()` raises
`SandboxUnavailable` saying so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import secrets
import select
import shutil
import signal
import socket
import subprocess
import time
from typing import Any, Iterable, Mapping

from environments.sandbox import cgroups, files, seccomp

log = logging.getLogger(__name__)

PYTHON = "/usr/bin/python3"  # the system interpreter: the runner and model-written Python use it
HOST_UIDS = (1 << 20, 1 << 31)  # where a root server draws each sandbox's host uid (no account uses them)
START_TIMEOUT_S = 60.0  # a loaded machine may take seconds to start a sandbox
GRACE_S = 10.0  # how long past a command's wall limit the host waits for the runner's answer
MAX_ANSWER_BYTES = 16 << 20  # far above any answer (outputs are capped at `output_bytes`)
MIN_PROCESS_MEMORY = 64 << 20  # per-process memory where no cgroup holds the session: what python3 needs
RUNNER = (pathlib.Path(__file__).parent / "runner.py").read_bytes()
RUNNER_INSIDE = "/sandbox/runner.py"
PRIVATE_MOUNTS = (("/work", "0755"), ("/tmp", "1777"), ("/dev/shm", "1777"))
INSTALL_HINT = "install it with `apt-get install -y bubblewrap` (Debian/Ubuntu; see docs/sandbox.md)"


class SandboxUnavailable(RuntimeError):
    """bubblewrap or the system Python is missing, or this machine refuses the namespaces."""


class SandboxError(RuntimeError):
    """The sandbox stopped answering or ended; it is closed and cannot be used again."""


class RequestFailed(SandboxError):
    """One request could not be done (a path outside /work or through a link, a FIFO where a file
    is written, a full disk, a tree past the read caps); the sandbox is intact."""

    def __init__(self, reason: str):
        super().__init__(f"the sandbox could not do the request: {reason}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one command and the whole session may use; `disk_bytes` and `inodes` also size `/work`,
    `/tmp` and `/dev/shm` for the sandbox's life."""

    cpu_s: float = 10.0  # CPU time per process (RLIMIT_CPU)
    wall_s: float = 10.0  # wall time of the whole command, then everything it started is killed
    memory_bytes: int = 512 << 20  # address space per process (RLIMIT_AS)
    processes: int = 64  # processes of the sandbox at once, the runner included (RLIMIT_NPROC, cgroup pids)
    output_bytes: int = 16 << 10  # stdout + stderr kept; past it the command is stopped
    disk_bytes: int = 16 << 20  # size of each private tmpfs, and the largest file (RLIMIT_FSIZE)
    inodes: int = 16384  # files and directories of each private tmpfs
    session_memory_bytes: int = 1 << 30  # memory of all the session's processes and its files (cgroup)
    cpus: float = 1.0  # CPU bandwidth of all the session's processes together (cgroup)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def per_process(self) -> Limits:
        """Where no cgroup holds the session: per-process memory and a process count whose product
        fits `session_memory_bytes` (at least `MIN_PROCESS_MEMORY` a process, fewer processes)."""
        memory = min(self.memory_bytes, max(MIN_PROCESS_MEMORY, self.session_memory_bytes // self.processes))
        processes = max(2, min(self.processes, self.session_memory_bytes // memory))  # the runner and one more
        return dataclasses.replace(self, memory_bytes=memory, processes=processes)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How one command ended and what it printed (each stream cut to fit `output_bytes`)."""

    exit_code: int  # 128 + N when killed by signal N, as bash reports it
    signal: str  # e.g. "SIGKILL", "SIG40"; "" when the command exited by itself
    stdout: str
    stderr: str
    timed_out: bool  # stopped at the wall-time limit
    truncated: bool  # stopped at the output limit; the streams hold what came before
    wall_s: float

    def render(self, limits: Limits) -> str:
        """The observation an agent reads: stdout, stderr, the exit code and any limit that hit."""
        parts = []
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout.rstrip(chr(10))}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr.rstrip(chr(10))}")
        if self.timed_out:
            parts.append(f"(stopped after the {limits.wall_s:g} s time limit)")
        elif self.truncated:
            parts.append(f"(output truncated: stopped after {limits.output_bytes} bytes of output)")
        elif self.signal:
            parts.append(f"(killed by {self.signal})")
        if not self.stdout and not self.stderr:
            parts.insert(0, "(no output)")
        parts.append(f"exit code: {self.exit_code}")
        return "\n".join(parts)


def _system_mounts() -> list[str]:
    """Read-only `/usr` and `/etc`, and `/bin`, `/lib`... as this machine has them (links or dirs)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args + ["--ro-bind", "/etc", "/etc"]


def _hide(paths: Iterable[str]) -> list[str]:
    """Covers each existing path below `/usr` or `/etc` (an empty read-only dir, or /dev/null)."""
    args: list[str] = []
    for path in map(os.path.realpath, paths):
        if not path.startswith(("/usr/", "/etc/")) or not os.path.exists(path):
            continue  # not mounted in the sandbox: nothing to hide
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        else:
            args += ["--ro-bind", "/dev/null", path]
    return args


def bwrap_command(hidden_paths: Iterable[str], info_fd: int, runner_fd: int, config: dict[str, Any]) -> list[str]:
    """The `bwrap` command line of one sandbox, ending in the runner (read from `runner_fd`).

    The runner starts as uid 0 of the new user namespace with the two capabilities its set-up
    needs there (mounting tmpfs with an inode cap, mapping its nested namespace) and drops them."""
    return [
        "bwrap", *_system_mounts(), *_hide(hidden_paths),
        "--proc", "/proc", "--dev", "/dev", "--dir", "/work", "--dir", "/tmp",
        "--ro-bind-data", str(runner_fd), RUNNER_INSIDE,
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--unshare-all", "--unshare-user", "--new-session", "--as-pid-1",
        "--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETFCAP",
        "--hostname", "sandbox", "--chdir", "/", "--clearenv", "--info-fd", str(info_fd),
        "--", PYTHON, "-I", "-S", RUNNER_INSIDE, json.dumps(config),
    ]


def check_available() -> None:
    """Raises `SandboxUnavailable` naming what is missing."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}")
    if not os.access(PYTHON, os.X_OK):
        raise SandboxUnavailable(f"the sandbox runs {PYTHON}, which is missing: `apt-get install -y python3`")


@functools.lru_cache(maxsize=None)
def _seccomp_hex() -> str:
    program = seccomp.program()
    return program.hex() if program else ""


def describe_walls(limits: Limits) -> str:
    """One line on how this server holds each session: its cgroups (or the fallback) and seccomp."""
    plan = cgroups.plan()
    if isinstance(plan, cgroups.Plan):
        held = plan.describe()
    else:
        fallback = limits.per_process()
        held = (f"no cgroup per sandbox ({plan}); per-process limits instead: {fallback.processes} processes "
                f"x {fallback.memory_bytes >> 20} MiB")
    filtered = "a seccomp filter" if _seccomp_hex() else f"no seccomp filter (no syscall table for {os.uname().machine})"
    return f"sandbox: {held}; {filtered}"


@functools.lru_cache(maxsize=None)
def announce(limits: Limits) -> None:
    """Logs `describe_walls` once per process (a server's start-up)."""
    check_available()
    log.warning(describe_walls(limits))


class Sandbox:
    """One session's sandbox: `run` commands, `write` and `read` files under `/work`, `close`.

    Not thread-safe: one call at a time (the server's session lock), except `close`, which may
    come from another thread and ends a call in flight with `SandboxError`.
    """

    def __init__(self, limits: Limits = Limits(), hidden_paths: Iterable[str] = ()):
        check_available()
        self.limits = limits
        self.closed = False
        self._pending = bytearray()
        self._scanned = 0  # bytes of `_pending` already searched for a newline
        self._pid1: int | None = None  # process 1 inside, as the host sees it
        self._work: int | None = None  # an O_PATH fd of the sandbox's /work
        root = os.geteuid() == 0
        self.host_uid = HOST_UIDS[0] + secrets.randbelow(HOST_UIDS[1] - HOST_UIDS[0]) if root else os.geteuid()
        self.host_gid = self.host_uid if root else os.getegid()
        plan = cgroups.plan()
        self.cgroup: cgroups.Group | None = None
        cgroup_fds: list[int] = []
        if isinstance(plan, cgroups.Plan):  # processes - 1: process 1 stays outside the group
            try:
                self.cgroup = cgroups.Group(plan, limits.session_memory_bytes, limits.processes - 1, limits.cpus)
                cgroup_fds = self.cgroup.join_files()
            except OSError as e:
                if self.cgroup:
                    self.cgroup.remove()
                raise SandboxUnavailable(f"could not make the sandbox's cgroup: {e}") from None
        self.command_limits = limits if self.cgroup else limits.per_process()
        self._channel, inside = socket.socketpair()
        info_r, info_w = os.pipe()
        runner_r, runner_w = os.pipe()  # the runner's source (well under a pipe's 64 KiB buffer)
        os.write(runner_w, RUNNER)
        os.close(runner_w)
        config = {"mounts": [[path, limits.disk_bytes, limits.inodes, mode] for path, mode in PRIVATE_MOUNTS],
                  "seccomp": _seccomp_hex(), "cgroup_fds": cgroup_fds}
        as_user = dict(user=self.host_uid, group=self.host_gid, extra_groups=[]) if root else {}
        try:
            self._proc = subprocess.Popen(
                bwrap_command(hidden_paths, info_w, runner_r, config), stdin=inside, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, pass_fds=(info_w, runner_r, *cgroup_fds), cwd="/", start_new_session=True,
                **as_user)
        except OSError:
            self._channel.close()
            if self.cgroup:
                self.cgroup.remove()
            raise
        finally:
            for fd in (info_w, runner_r, *cgroup_fds):
                os.close(fd)
            inside.close()
        try:
            self._pid1 = self._read_info(info_r)
            ready = self._answer(time.monotonic() + START_TIMEOUT_S)
            self._work = os.open(f"/proc/{self._pid1}/root/work", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (SandboxError, OSError) as e:
            self.close()
            raise SandboxUnavailable(f"bubblewrap could not start a sandbox: {e}") from None
        finally:
            os.close(info_r)
        if ready != {"ready": True}:
            self.close()
            raise SandboxUnavailable(f"the sandbox runner did not start: {ready}")

    def _read_info(self, info_r: int) -> int:
        """bwrap's `--info-fd` JSON -> the host pid of process 1 inside."""
        data = b""
        while chunk := os.read(info_r, 4096):
            data += chunk
        if not data:
            raise SandboxError(self._last_words() or f"bwrap exited with {self._proc.returncode}")
        return int(json.loads(data)["child-pid"])

    def _last_words(self) -> str:
        """Closes a sandbox whose process 1 ended; what bwrap and the runner printed last."""
        self.kill_process_1()
        try:
            self._proc.wait(timeout=10)
            stderr = self._proc.stderr.read().decode(errors="replace").strip()[-2000:]
        except (subprocess.TimeoutExpired, OSError, ValueError):
            stderr = ""
        self.close()
        return stderr

    def _answer(self, deadline: float) -> dict[str, Any]:
        """The runner's next JSON line; past `deadline`, or if it ended, the sandbox is closed.
        Linear in the bytes read: each byte is searched for the newline once."""
        while (newline := self._pending.find(b"\n", self._scanned)) < 0:
            self._scanned = len(self._pending)
            if self.closed:
                raise SandboxError("the sandbox was closed")
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and select.select([self._channel], [], [], left)[0]
                chunk = self._channel.recv(1 << 16) if ready else b""
            except (OSError, ValueError):  # `close()` from another thread took the socket away
                raise SandboxError("the sandbox was closed") from None
            if not ready:
                self.close()
                raise SandboxError("the sandbox stopped answering; it was killed")
            if not chunk:
                if self.closed:
                    raise SandboxError("the sandbox was closed")
                stderr = self._last_words()
                raise SandboxError(f"the sandbox ended{': ' + stderr if stderr else ''}")
            self._pending += chunk
            if len(self._pending) > MAX_ANSWER_BYTES:
                self.close()
                raise SandboxError(f"the sandbox's answer passed {MAX_ANSWER_BYTES} bytes; it was killed")
        line = bytes(self._pending[:newline])
        del self._pending[:newline + 1]
        self._scanned = 0
        return json.loads(line)

    def run(self, command: str, stdin: str = "", give_fds: Iterable[int] = ()) -> RunResult:
        """Runs `bash -c command` in `/work` under the limits. `give_fds` (at most four) become the
        command's fds 3, 4, ...; this process's copies are closed once sent."""
        give_fds = list(give_fds)
        try:
            if self.closed:
                raise SandboxError("the sandbox was closed")
            request = json.dumps({"op": "run", "command": command, "stdin": stdin,
                                  "limits": self.command_limits.as_json()}).encode() + b"\n"
            try:
                sent = socket.send_fds(self._channel, [request], give_fds)
                self._channel.sendall(request[sent:])
            except (OSError, ValueError):
                self.close()
                raise SandboxError("the sandbox ended") from None
        finally:
            for fd in give_fds:
                os.close(fd)
        answer = self._answer(time.monotonic() + self.limits.wall_s + GRACE_S)
        if "error" in answer:
            raise RequestFailed(answer["error"])
        return RunResult(**answer)

    def _files(self) -> int:
        if self.closed or self._work is None:
            raise SandboxError("the sandbox was closed")
        return self._work

    def write(self, texts: Mapping[str, str], executable: Iterable[str] = ()) -> None:
        """Writes text files at paths relative to `/work` (parents made); `executable` ones get mode 755.
        A symbolic link, a FIFO or any other non-regular file in the way is refused, never followed."""
        try:
            files.write(self._files(), texts, executable, (self.host_uid, self.host_gid))
        except files.FileRefused as e:
            raise RequestFailed(str(e)) from None

    def read(self, paths: Iterable[str], max_bytes: int = 1 << 16) -> dict[str, str | None]:
        """Path -> text of each regular file (a directory gives all files below it); None where
        there is no regular file. Read by the host without following links; a tree past
        `files.MAX_ENTRIES`, `MAX_DEPTH` or `MAX_TOTAL_BYTES` raises `RequestFailed`."""
        try:
            return files.read(self._files(), paths, max_bytes)
        except files.FileRefused as e:
            raise RequestFailed(str(e)) from None

    def kill_process_1(self) -> None:
        """Kills process 1 (the kernel then kills everything in the namespace)."""
        if self._proc.poll() is None and self._pid1 is not None:
            try:
                os.kill(self._pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kills process 1, reaps bwrap, removes the cgroup."""
        if self.closed:
            return
        self.closed = True
        self.kill_process_1()
        if self._work is not None:
            os.close(self._work)
            self._work = None
        self._channel.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stderr.close()
        if self.cgroup:
            self.cgroup.remove()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
