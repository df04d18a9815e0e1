"""The sandbox's process 1: finishes the sandbox from inside, then runs the host's commands, one at a time.

Standard library only: the host starts it under bubblewrap as `python3 -I -S runner.py <config>`
(`sandbox.py`), as uid 0 of a new user namespace with CAP_SYS_ADMIN and CAP_SETFCAP there and
nowhere else. Before it answers `{"ready": true}` it
1. mounts `/work`, `/tmp` and `/dev/shm` as tmpfs of the configured size and inode count (the
   inode cap is what bubblewrap's own tmpfs mounts lack);
2. enters a nested user namespace in which it is uid 1000, drops every capability (its bounding
   set too), sets no_new_privs and becomes non-dumpable;
3. installs the seccomp filter the host assembled (`seccomp.py`), which its commands inherit.
Commands therefore run as uid 1000 with no capability in any namespace.

Requests and answers are JSON lines over a Unix socket on fd 0:

    {"op": "run", "command": str, "stdin": str, "limits": {...}}  -> a `RunResult` as JSON

File descriptors sent with a request become fds 3, 4, ... of the command (the `code`
environment's grader talks to the candidate function over them). Each command joins the
session's cgroups itself before it executes, by writing 0 to the files the host opened and
passed down (`cgroups.Group.join_files`), so process 1 stays outside them and no out-of-memory
kill in the group picks it.

Process 1 never opens a file of the sandbox (the host reads and writes them, `files.py`), so no
file an agent makes can steer it. It answers every request: an exception is an `{"error"}`
answer after everything the command started is killed. While a command runs it watches its
socket only for the host hanging up, never reading from it; the host going away ends the
sandbox, even mid-command. Being process 1 of the pid namespace makes the kill clean: every
process a command leaves is re-parented here, `kill(-1, SIGKILL)` reaches all of them, and once
`waitpid` has no child left nothing of the command survives. Signals a command sends to process
1 are dropped by the kernel (no handler is installed), and being non-dumpable, no command can
trace it or open its socket.
"""

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import socket
import sys
import time

WORK = "/work"
SHELL = "/bin/bash"
UID = 1000  # what commands see; the host's uid of the sandbox stays what bubblewrap mapped
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
       "LC_ALL": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1", "USER": "sandbox"}
OPEN_FILES = 256
READ_CHUNK = 65536
MAX_PASSED_FDS = 4
HIGH_FD = 100  # where fds are parked while a command's fds 0, 1, 2, 3... are laid out
# prctl options and flags (linux/prctl.h, linux/sched.h, linux/mount.h, linux/capability.h)
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 4, 24, 38, 22, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
CLONE_NEWUSER, MS_NOSUID, MS_NODEV = 0x10000000, 2, 4
CAPABILITY_VERSION_3, LAST_CAPABILITY = 0x20080522, 63
BPF_INSTRUCTION_BYTES = 8

libc = ctypes.CDLL(None, use_errno=True)


class HostGone(Exception):
    """The host closed its end of the socket: the host process ended."""


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option, arg=0):
    return libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def set_up(config):
    """Mounts, the nested user namespace, no capabilities, the seccomp filter (see the module doc)."""
    for path, size, inodes, mode in config["mounts"]:
        options = f"size={size},nr_inodes={inodes},mode={mode}".encode()
        _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options), f"mount {path}")
    _check(libc.unshare(CLONE_NEWUSER), "unshare a user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{UID} 0 1"), ("gid_map", f"{UID} 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    for capability in range(LAST_CAPABILITY + 1):
        _prctl(PR_CAPBSET_DROP, capability)  # EINVAL past the kernel's last capability
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clear ambient capabilities")
    _check(libc.capset(ctypes.byref(CapHeader(CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "drop capabilities")
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "set no_new_privs")
    _check(_prctl(PR_SET_DUMPABLE, 0), "become non-dumpable")
    if config["seccomp"]:
        code = bytes.fromhex(config["seccomp"])
        buffer = ctypes.create_string_buffer(code, len(code))
        program = SockFprog(len(code) // BPF_INSTRUCTION_BYTES, ctypes.addressof(buffer))
        _check(libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(program),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)), "install the seccomp filter")
    os.chdir(WORK)


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


def signal_name(number):
    """SIGKILL, SIGXCPU...; a signal Python has no name for (a real-time one) as SIG<n>."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _child(command, fds, limits, cgroup_fds):
    """In the forked child: own session, the session's cgroups, fds 0, 1, 2, 3..., the limits, the shell."""
    try:
        os.setsid()
        for fd in cgroup_fds:
            os.write(fd, b"0")  # moves this process, which has one thread, into the group
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # an out-of-memory kill takes commands first
        parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD) for fd in fds]
        for target, fd in enumerate(parked):
            os.dup2(fd, target)
        os.closerange(len(fds), 1 << 16)
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
    except BaseException as e:
        os.write(2, f"sandbox: could not start the command: {type(e).__name__}: {e}\n".encode())
    finally:
        os._exit(127)


def run(request, passed, channel, cgroup_fds):
    """Runs `bash -c command` in /work with the limits; returns what it printed and how it ended."""
    limits = request["limits"]
    stdin_data = request.get("stdin", "").encode()
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request["command"], [stdin_r, out_w, err_w, *passed], limits, cgroup_fds)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(channel, select.POLLRDHUP)  # only a hang-up is reported: the request channel is not read
    poller.register(pidfd, select.POLLIN)
    captured = {out_r: bytearray(), err_r: bytearray()}
    for fd in captured:
        poller.register(fd, select.POLLIN)
    os.set_blocking(stdin_w, False)
    if stdin_data:
        poller.register(stdin_w, select.POLLOUT)
    else:
        os.close(stdin_w)
        stdin_w = None
    deadline = start + limits["wall_s"]
    budget = limits["output_bytes"]
    status = None
    timed_out = truncated = False
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, events in poller.poll(max(1, int(left * 1000))):
            if fd == channel:
                raise HostGone()
            if fd == stdin_w:
                try:
                    stdin_data = stdin_data[os.write(stdin_w, stdin_data[:READ_CHUNK]):]
                except BrokenPipeError:
                    stdin_data = b""
                if not stdin_data:
                    poller.unregister(stdin_w)
                    os.close(stdin_w)
                    stdin_w = None
            elif fd in captured:
                chunk = os.read(fd, READ_CHUNK)
                captured[fd] += chunk
                if not chunk:
                    poller.unregister(fd)
            elif fd == pidfd:
                status = os.waitpid(pid, 0)[1]
        if len(captured[out_r]) + len(captured[err_r]) > budget:
            truncated = True
            break
    if status is None:  # the wall clock or the output limit stopped it
        os.kill(-1, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    else:  # it ended by itself: take what it left in the pipes, then stop what it started
        for fd, data in captured.items():
            os.set_blocking(fd, False)
            try:
                while len(data) <= budget and (chunk := os.read(fd, READ_CHUNK)):
                    data += chunk
            except BlockingIOError:
                pass
    kill_everything()
    wall_s = time.monotonic() - start
    for fd in (pidfd, out_r, err_r) + ((stdin_w,) if stdin_w is not None else ()):
        os.close(fd)
    stdout, stderr = bytes(captured[out_r]), bytes(captured[err_r])
    if len(stdout) + len(stderr) > budget:
        truncated = True
        stdout = stdout[:budget]
        stderr = stderr[:max(0, budget - len(stdout))]
    signaled = os.WIFSIGNALED(status)
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status),
        "signal": signal_name(os.WTERMSIG(status)) if signaled else "",
        "stdout": stdout.decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "timed_out": timed_out,
        "truncated": truncated,
        "wall_s": round(wall_s, 4),
    }


def requests(channel):
    """(request line, fds sent with it) until the host closes the socket; linear in the bytes read."""
    pending, fds, scanned = bytearray(), [], 0
    while True:
        newline = pending.find(b"\n", scanned)
        if newline < 0:
            scanned = len(pending)
            data, received, _, _ = socket.recv_fds(channel, READ_CHUNK, MAX_PASSED_FDS)
            fds += received
            if not data:
                return
            pending += data
            continue
        line = bytes(pending[:newline])
        del pending[:newline + 1]
        scanned = 0
        yield line, fds
        fds = []


def answer(request_line, fds, channel, cgroup_fds):
    """The answer to one request; every exception but the host's going away becomes `{"error"}`."""
    try:
        request = json.loads(request_line)
        if request.get("op") != "run":
            raise ValueError(f"unknown op {request.get('op')!r}; the runner only runs commands")
        return run(request, fds, channel.fileno(), cgroup_fds)
    except HostGone:
        raise
    except BaseException as e:
        kill_everything()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        for fd in fds:
            os.close(fd)


def main():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # process 1 ignores signals without a handler
    os.umask(0o022)
    config = json.loads(sys.argv[1])
    channel = socket.socket(fileno=0)
    # the cgroup files move up, out of the way of the fds each command gets
    cgroup_fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in config["cgroup_fds"]]
    for fd in config["cgroup_fds"]:
        os.close(fd)
    try:
        set_up(config)
    except BaseException as e:
        channel.sendall(json.dumps({"error": f"set-up failed: {type(e).__name__}: {e}"}).encode() + b"\n")
        return
    channel.sendall(b'{"ready": true}\n')
    try:
        for line, fds in requests(channel):
            channel.sendall(json.dumps(answer(line, fds, channel, cgroup_fds)).encode() + b"\n")
    except (HostGone, OSError):
        pass
    # returning ends process 1, and with it every process left in the namespace


main()
