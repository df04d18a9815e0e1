"""One bubblewrap sandbox per session, for every environment that runs model-written code.

A `Sandbox` is a long-lived `bwrap` process holding new user, pid, mount, network, IPC and UTS
namespaces. Inside, the system (`/usr`, `/etc`) is mounted read-only, the root and `/dev` are
read-only, `/work` (the session's work directory, also `$HOME`) and `/tmp` are private tmpfs
mounts of `disk_bytes` each, and there is no network but an empty loopback. Process 1 inside is
`runner.py`, which runs each command as `bash -c` in `/work` with CPU-time, address-space,
process-count, file-size and open-file rlimits, stops it at the wall-time or output limit, and
then kills every process the command left. Files persist between commands of a session;
processes, the working directory and shell variables do not.

Run as root (a container), each sandbox also gets its own unprivileged host uid, so nothing in
it is uid 0 anywhere. `close()` kills process 1, which ends every process in the namespace; the
runner also leaves when the host process dies (its input closes). Install bubblewrap with
`apt-get install -y bubblewrap`; without it `Sandbox()` raises `SandboxUnavailable` saying so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import select
import shutil
import signal
import subprocess
import time
from typing import Any, Iterable, Mapping

PYTHON = "/usr/bin/python3"  # the system interpreter: the runner and model-written Python use it
INSIDE_UID = 1000  # the uid commands see; mapped to a fresh host uid per sandbox when we are root
HOST_UIDS = (1 << 20, 1 << 31)  # where those host uids are drawn (no account uses them)
START_TIMEOUT_S = 60.0  # a loaded machine may take seconds to start a sandbox
GRACE_S = 10.0  # how long past a command's wall limit the host waits for the runner's answer
RUNNER = (pathlib.Path(__file__).parent / "runner.py").read_bytes()
RUNNER_INSIDE = "/sandbox/runner.py"
INSTALL_HINT = "install it with `apt-get install -y bubblewrap` (Debian/Ubuntu; see docs/sandbox.md)"


class SandboxUnavailable(RuntimeError):
    """bubblewrap or the system Python is missing, or this machine refuses the namespaces."""


class SandboxError(RuntimeError):
    """The sandbox stopped answering or ended; it is closed and cannot be used again."""


class RequestFailed(SandboxError):
    """The runner could not do one request (a path outside /work, a full disk); the sandbox is intact."""

    def __init__(self, reason: str):
        super().__init__(f"the sandbox runner could not do the request: {reason}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one command may use; `disk_bytes` also sizes `/work` and `/tmp` for the sandbox's life."""

    cpu_s: float = 10.0  # CPU time per process (RLIMIT_CPU)
    wall_s: float = 10.0  # wall time of the whole command, then everything it started is killed
    memory_bytes: int = 512 << 20  # address space per process (RLIMIT_AS)
    processes: int = 64  # processes of the sandbox at once, the runner included (RLIMIT_NPROC)
    output_bytes: int = 16 << 10  # stdout + stderr kept; past it the command is stopped
    disk_bytes: int = 16 << 20  # size of /work and of /tmp (tmpfs), and the largest file (RLIMIT_FSIZE)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How one command ended and what it printed (each stream cut to fit `output_bytes`)."""

    exit_code: int  # 128 + N when killed by signal N, as bash reports it
    signal: str  # e.g. "SIGKILL"; "" when the command exited by itself
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


def bwrap_command(limits: Limits, hidden_paths: Iterable[str], info_fd: int, runner_fd: int) -> list[str]:
    """The `bwrap` command line of one sandbox, ending in the runner (read from `runner_fd`)."""
    size = str(limits.disk_bytes)
    return [
        "bwrap", *_system_mounts(), *_hide(hidden_paths),
        "--proc", "/proc", "--dev", "/dev",
        "--size", size, "--tmpfs", "/dev/shm",
        "--size", size, "--tmpfs", "/work",
        "--size", size, "--tmpfs", "/tmp",
        "--ro-bind-data", str(runner_fd), RUNNER_INSIDE,
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--unshare-all", "--unshare-user", "--disable-userns", "--new-session", "--as-pid-1",
        "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox",
        "--chdir", "/work", "--clearenv", "--info-fd", str(info_fd),
        "--", PYTHON, "-I", "-S", RUNNER_INSIDE,
    ]


def check_available() -> None:
    """Raises `SandboxUnavailable` naming what is missing."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}")
    if not os.access(PYTHON, os.X_OK):
        raise SandboxUnavailable(f"the sandbox runs {PYTHON}, which is missing: `apt-get install -y python3`")


class Sandbox:
    """One session's sandbox: `run` commands, `write` and `read` files under `/work`, `close`.

    Not thread-safe: one call at a time (the server's session lock), except `close`, which may
    come from another thread and ends a call in flight with `SandboxError`.
    """

    def __init__(self, limits: Limits = Limits(), hidden_paths: Iterable[str] = ()):
        check_available()
        self.limits = limits
        root = os.geteuid() == 0
        self.host_uid = HOST_UIDS[0] + secrets.randbelow(HOST_UIDS[1] - HOST_UIDS[0]) if root else os.geteuid()
        self.closed = False
        self._pending = b""
        self._pid1: int | None = None  # process 1 inside, as the host sees it
        info_r, info_w = os.pipe()
        runner_r, runner_w = os.pipe()  # the runner's source (well under a pipe's 64 KiB buffer)
        os.write(runner_w, RUNNER)
        os.close(runner_w)
        as_user = dict(user=self.host_uid, group=self.host_uid, extra_groups=[]) if root else {}
        try:
            self._proc = subprocess.Popen(
                bwrap_command(limits, hidden_paths, info_w, runner_r), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(info_w, runner_r), cwd="/",
                start_new_session=True, **as_user)
        finally:
            os.close(info_w)
            os.close(runner_r)
        try:
            self._pid1 = self._read_info(info_r)
            ready = self._answer(time.monotonic() + START_TIMEOUT_S)
        except SandboxError as e:
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
            self._proc.wait(START_TIMEOUT_S)
            stderr = self._proc.stderr.read().decode(errors="replace").strip()
            self.close()
            raise SandboxError(f"{stderr or 'bwrap exited with ' + str(self._proc.returncode)}")
        return int(json.loads(data)["child-pid"])

    def _answer(self, deadline: float) -> dict[str, Any]:
        """The runner's next JSON line; past `deadline`, or if it ended, the sandbox is closed."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if self.closed:
                raise SandboxError("the sandbox was closed")
            try:
                ready = left > 0 and select.select([fd], [], [], left)[0]
                chunk = os.read(fd, 1 << 16) if ready else b""
            except (OSError, ValueError):  # `close()` from another thread took the pipe away
                raise SandboxError("the sandbox was closed") from None
            if not ready:
                self.close()
                raise SandboxError("the sandbox stopped answering; it was killed")
            if not chunk:
                if self.closed:
                    raise SandboxError("the sandbox was closed")
                stderr = self._proc.stderr.read1().decode(errors="replace").strip()
                self.close()
                raise SandboxError(f"the sandbox ended{': ' + stderr[-2000:] if stderr else ''}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.closed:
            raise SandboxError("the sandbox was closed")
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self.close()
            raise SandboxError("the sandbox ended") from None
        answer = self._answer(time.monotonic() + timeout_s)
        if "error" in answer:
            raise RequestFailed(answer["error"])
        return answer

    def run(self, command: str, stdin: str = "") -> RunResult:
        """Runs `bash -c command` in `/work` under the limits."""
        answer = self._call({"op": "run", "command": command, "stdin": stdin, "limits": self.limits.as_json()},
                            self.limits.wall_s + GRACE_S)
        return RunResult(**answer)

    def write(self, files: Mapping[str, str], executable: Iterable[str] = ()) -> None:
        """Writes text files at paths relative to `/work` (parents made); `executable` ones get mode 755."""
        self._call({"op": "write", "files": dict(files), "executable": list(executable)}, GRACE_S)

    def read(self, paths: Iterable[str], max_bytes: int = 1 << 16) -> dict[str, str | None]:
        """Path -> text of each regular file (a directory gives all files below it); None where
        there is no regular file. Read by process 1, so no command can interfere."""
        return self._call({"op": "read", "paths": list(paths), "max_bytes": max_bytes}, GRACE_S)["files"]

    def close(self) -> None:
        """Kills process 1 (the kernel then kills everything in the namespace) and reaps bwrap."""
        if self.closed:
            return
        self.closed = True
        if self._proc.poll() is None and self._pid1 is not None:
            try:
                os.kill(self._pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
