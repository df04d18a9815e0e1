"""The sandbox's process 1: runs the host's requests, one at a time, inside the namespaces.

Standard library only: the host starts it as `python3 -I -S -c <this file>` under bubblewrap
(`sandbox.py`). Requests and answers are JSON lines on fd 0 and fd 1:

    {"op": "run", "command": str, "stdin": str, "limits": {...}}  -> a `RunResult` as JSON
    {"op": "write", "files": {path: text}, "executable": [path]}   -> {"written": n}
    {"op": "read", "paths": [path], "max_bytes": n}                -> {"files": {path: text | null}}

Being process 1 of the pid namespace is what makes the kill clean: every process the command
leaves is re-parented here, `kill(-1, SIGKILL)` reaches all of them, and once `waitpid` has no
child left nothing of the command survives. Signals a command sends to process 1 are dropped by
the kernel (no handler is installed), and the runner is not dumpable, so a command can neither
trace it nor open its pipes to the host. End of input on fd 0 (the host went away) ends the
sandbox, even mid-command.
"""

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

WORK = "/work"
SHELL = "/bin/bash"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
       "LC_ALL": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1", "USER": "sandbox"}
OPEN_FILES = 256
READ_CHUNK = 65536
PR_SET_DUMPABLE = 4


class HostGone(Exception):
    """fd 0 closed: the host process ended."""


def kill_everything():
    """SIGKILL to every process in the namespace but this one, until none is left to reap."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _child(command, stdin_r, out_w, err_w, limits):
    """In the forked child: own session, the limits, the pipes, then the shell."""
    try:
        os.setsid()
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        cpu = max(1, int(limits["cpu_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["disk_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(WORK)
        os.execve(SHELL, [SHELL, "-c", command], ENV)
    finally:
        os._exit(127)


def run(request):
    """Runs `bash -c command` in /work with the limits; returns what it printed and how it ended."""
    limits = request["limits"]
    stdin_data = request.get("stdin", "").encode()
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request["command"], stdin_r, out_w, err_w, limits)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    deadline = start + limits["wall_s"]
    captured = {out_r: bytearray(), err_r: bytearray()}
    open_fds = {out_r, err_r}
    os.set_blocking(stdin_w, False)
    writing = [stdin_w] if stdin_data else []
    if not stdin_data:
        os.close(stdin_w)
    status = None
    timed_out = truncated = False
    budget = limits["output_bytes"]
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        readable, writable, _ = select.select([0, pidfd, *open_fds], writing, [], left)
        if 0 in readable and not os.read(0, 1):
            raise HostGone()
        if writable:
            try:
                stdin_data = stdin_data[os.write(stdin_w, stdin_data[:READ_CHUNK]):]
            except BrokenPipeError:
                stdin_data = b""
            if not stdin_data:
                os.close(stdin_w)
                writing = []
        for fd in readable:
            if fd in open_fds:
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    open_fds.discard(fd)
                captured[fd] += chunk
        if sum(map(len, captured.values())) > budget:
            truncated = True
            break
        if pidfd in readable:
            status = os.waitpid(pid, 0)[1]
    if status is None:  # the wall clock or the output limit stopped it
        os.kill(-1, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    else:  # it ended by itself: take what it left in the pipes, then stop what it started
        for fd in list(open_fds):
            os.set_blocking(fd, False)
            try:
                while chunk := os.read(fd, READ_CHUNK):
                    captured[fd] += chunk
                    if len(chunk) < READ_CHUNK:
                        break
            except BlockingIOError:
                pass
    kill_everything()
    wall_s = time.monotonic() - start
    for fd in (pidfd, out_r, err_r, *writing):
        os.close(fd)
    stdout, stderr = bytes(captured[out_r]), bytes(captured[err_r])
    if len(stdout) + len(stderr) > budget:
        truncated = True
        stdout = stdout[:budget]
        stderr = stderr[:max(0, budget - len(stdout))]
    signaled = os.WIFSIGNALED(status)
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status),
        "signal": signal.Signals(os.WTERMSIG(status)).name if signaled else "",
        "stdout": stdout.decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "timed_out": timed_out,
        "truncated": truncated,
        "wall_s": round(wall_s, 4),
    }


def _inside_work(path):
    """`path` relative to /work, refusing anything that leaves it (absolute paths, `..`)."""
    if os.path.isabs(path) or ".." in path.split("/") or not path.strip("/"):
        raise ValueError(f"path {path!r} must be relative and stay inside {WORK}")
    return os.path.join(WORK, path)


def write(request):
    """Writes text files under /work (parents made), some executable."""
    executable = set(request.get("executable", ()))
    for path, text in request["files"].items():
        full = _inside_work(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(full, 0o755 if path in executable else 0o644)
    return {"written": len(request["files"])}


def _read_regular(full, max_bytes):
    """A regular file's text (at most max_bytes), or None: missing, not regular (a FIFO, a link
    to a device...), or unreadable. Opened non-blocking so a FIFO cannot hang the runner."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, max_bytes).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def read(request):
    """Texts of files under /work; a directory path gives every regular file below it (sorted)."""
    files = {}
    for path in request["paths"]:
        full = _inside_work(path)
        if os.path.isdir(full) and not os.path.islink(full):
            for root, dirs, names in os.walk(full):
                dirs.sort()
                for name in sorted(names):
                    rel = os.path.relpath(os.path.join(root, name), WORK)
                    files[rel] = _read_regular(os.path.join(root, name), request["max_bytes"])
        else:
            files[path] = _read_regular(full, request["max_bytes"])
    return {"files": files}


OPS = {"run": run, "write": write, "read": read}


def requests():
    """The host's requests, one JSON line each, until it closes fd 0."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(0, READ_CHUNK)
            if not chunk:
                return  # the host closed our input
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield json.loads(line)


def main():
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # process 1 ignores signals without a handler
    os.umask(0o022)
    out = os.fdopen(1, "w", encoding="utf-8")
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for request in requests():
        try:
            answer = OPS[request["op"]](request)
        except HostGone:
            return
        except (OSError, ValueError, KeyError) as e:
            kill_everything()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    # returning ends process 1, and with it every process left in the namespace


main()
