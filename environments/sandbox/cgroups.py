"""A cgroup per sandbox: the kernel limits a session as a whole, not each of its processes.

A sandbox's group caps its memory (the kernel memory of its files' inodes and dentries
included, which is what a flood of empty files or symlinks costs), its number of processes and
its CPU bandwidth. With cgroup v2, where the server's parent group delegates the memory and pids
controllers, the groups are `<parent>/agentgym-<server pid>/sandbox-<hex>`; with cgroup v1
(memory and pids writable: root on these machines), one `agentgym-<server pid>/sandbox-<hex>`
below the server's own group in each of the memory, pids and (where mounted) cpu hierarchies.

The host opens the file through which a process joins each of the group's directories and
hands the open files to the sandbox's process 1, whose commands write 0 to them (join
themselves) before they execute: process 1 stays outside, so an out-of-memory kill in the group
never picks it. On v1 that file is `tasks`: a process with one thread moving itself through it
skips the kernel's global threadgroup lock, which moving a process through `cgroup.procs` takes
(an RCU grace period that stalls every fork on the machine); v2 has only `cgroup.procs`.
`plan()` says once per process how groups are made, or why they cannot be; then sandboxes fall
back to per-process rlimits sized to the session's budget (`Limits.per_process`). Groups a
killed server left are removed by the next server that plans groups in the same place.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import secrets
import time
from typing import Any

V1_CONTROLLERS = ("memory", "pids", "cpu")  # cpu is optional
CPU_PERIOD_US = 100_000
PREFIX = "agentgym-"
REMOVE_TIMEOUT_S = 2.0  # processes of a closed sandbox may take a moment to leave its group


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where this server makes sandbox groups: one base directory per hierarchy."""

    version: int  # 1 or 2
    bases: dict[str, str]  # "memory", "pids", "cpu" (v1) or "unified" (v2) -> this server's directory
    controllers: tuple[str, ...]

    def describe(self) -> str:
        return (f"a cgroup v{self.version} per sandbox ({', '.join(self.controllers)}) below "
                f"{', '.join(sorted(self.bases.values()))}")


def _mounts() -> dict[str, tuple[str, str]]:
    """Hierarchy -> (mount point, root inside the hierarchy): v1 controllers by name, v2 as "unified"."""
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields, (fs_type, _, options) = before.split(), after.split()[:3]
            if fs_type == "cgroup2":
                mounts.setdefault("unified", (fields[4], fields[3]))
            elif fs_type == "cgroup":
                for controller in set(options.split(",")) & set(V1_CONTROLLERS):
                    mounts.setdefault(controller, (fields[4], fields[3]))
    return mounts


def _own_groups() -> dict[str, str]:
    """Hierarchy -> this process's group path (from /proc/self/cgroup)."""
    groups = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else ["unified"]:
                groups[controller] = path
    return groups


def _directory(mount: tuple[str, str], group: str) -> str:
    point, root = mount
    relative = os.path.relpath(group, root) if group.startswith(root) else group.lstrip("/")
    return os.path.normpath(os.path.join(point, relative))


def _remove_stale(directory: str) -> None:
    """Removes the (empty) groups of servers that are gone: `agentgym-<pid>` whose pid is not alive."""
    for name in os.listdir(directory):
        pid = name[len(PREFIX):]
        if not (name.startswith(PREFIX) and pid.isdigit()) or _alive(int(pid)):
            continue
        base = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            for child in os.scandir(base):
                if child.is_dir(follow_symlinks=False):
                    os.rmdir(child.path)
            os.rmdir(base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_base(parent: str) -> str:
    _remove_stale(parent)
    base = os.path.join(parent, f"{PREFIX}{os.getpid()}")
    os.makedirs(base, exist_ok=True)
    atexit.register(_try_rmdir, base)  # empty once every sandbox of this server is closed
    return base


def _try_rmdir(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _plan_v1(mounts: dict[str, tuple[str, str]], own: dict[str, str]) -> Plan | str:
    bases = {}
    for controller in V1_CONTROLLERS:
        if controller not in mounts or controller not in own:
            if controller == "cpu":
                continue
            return f"cgroup v1 has no {controller} hierarchy here"
        parent = _directory(mounts[controller], own[controller])
        try:
            bases[controller] = _make_base(parent)
        except OSError as e:
            if controller == "cpu":
                continue
            return f"cannot make cgroups in {parent}: {e.strerror}"
    return Plan(1, bases, tuple(bases))


def _plan_v2(mount: tuple[str, str], group: str) -> Plan | str:
    own = _directory(mount, group)
    parent = own if own == os.path.normpath(mount[0]) else os.path.dirname(own)
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            delegated = f.read().split()
        if not {"memory", "pids"} <= set(delegated):
            return (f"cgroup v2: {parent} does not delegate the memory and pids controllers "
                    f"(its cgroup.subtree_control: {' '.join(delegated) or 'empty'})")
        base = _make_base(parent)
        wanted = [c for c in ("memory", "pids", "cpu") if c in delegated]
        _write(base, "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
    except OSError as e:
        return f"cgroup v2: cannot make cgroups in {parent}: {e.strerror}"
    return Plan(2, {"unified": base}, tuple(wanted))


@functools.lru_cache(maxsize=None)
def plan() -> Plan | str:
    """How this process makes sandbox groups, or why it cannot (a sentence)."""
    try:
        mounts, own = _mounts(), _own_groups()
    except OSError as e:
        return f"cannot read this process's cgroups: {e}"
    if "memory" in mounts:
        return _plan_v1(mounts, own)
    if "unified" in mounts and "unified" in own:
        return _plan_v2(mounts["unified"], own["unified"])
    return "no cgroup file system with a memory controller is mounted"


def _write(directory: str, name: str, value: Any) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _settings(version: int, hierarchy: str, memory: int, processes: int, cpus: float) -> list[tuple[str, Any, bool]]:
    """(file, value, required) for one group; optional files (swap, where accounted) may be missing."""
    quota = max(1000, int(cpus * CPU_PERIOD_US))
    if version == 2:
        return [("memory.max", memory, True), ("memory.swap.max", 0, False), ("pids.max", processes, True),
                ("cpu.max", f"{quota} {CPU_PERIOD_US}", False)]
    return {"memory": [("memory.limit_in_bytes", memory, True), ("memory.memsw.limit_in_bytes", memory, False)],
            "pids": [("pids.max", processes, True)],
            "cpu": [("cpu.cfs_period_us", CPU_PERIOD_US, True), ("cpu.cfs_quota_us", quota, True)]}[hierarchy]


class Group:
    """One sandbox's cgroup (one directory per hierarchy), made with its limits."""

    def __init__(self, plan: Plan, memory_bytes: int, processes: int, cpus: float):
        name = f"sandbox-{secrets.token_hex(6)}"
        self.version = plan.version
        self.directories: list[str] = []
        try:
            for hierarchy, base in plan.bases.items():
                directory = os.path.join(base, name)
                os.makedirs(directory)  # the base too, should another server's sweep have taken it empty
                self.directories.append(directory)
                for file, value, required in _settings(plan.version, hierarchy, memory_bytes, processes, cpus):
                    try:
                        _write(directory, file, value)
                    except OSError:
                        if required:
                            raise
        except OSError:
            self.remove()
            raise

    def join_files(self) -> list[int]:
        """Write-only fds through which a process joins the group: writing 0 moves the writer."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return [os.open(os.path.join(d, name), os.O_WRONLY | os.O_CLOEXEC) for d in self.directories]

    def remove(self) -> None:
        """Removes the directories once their processes have left (a few ms after a kill)."""
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for directory in self.directories:
            while True:
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left for the next server's sweep
                    time.sleep(0.01)
        self.directories = []
