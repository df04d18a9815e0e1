"""A sandbox's files, read and written from the host, so that no file an agent made can steer the host.

Every path is walked one component at a time from an open directory (the sandbox's `/work`,
reached through `/proc/<process 1>/root`), each step `O_NOFOLLOW`: a symbolic link among the
folders of a path, `..` or an absolute path refuses it, and nothing is read from or written to a
file that `fstat` does not call regular (a FIFO, a socket, a directory): a read gives None, a
write replaces a link, FIFO or socket by a new regular file; no open can block (`O_NONBLOCK`).
A directory is walked iteratively under caps on depth, entries and bytes: a hostile tree costs
a bounded amount and is refused past them. Refusals are `FileRefused` with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from typing import Iterable, Iterator, Mapping

MAX_DEPTH = 32  # directory levels below a path that is read
MAX_ENTRIES = 4096  # names met in one read
MAX_TOTAL_BYTES = 1 << 20  # text returned by one read
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)


class FileRefused(Exception):
    """A path or a tree the host will not read or write; the sandbox itself is fine."""


def parts(path: str) -> list[str]:
    """The components of a path relative to /work; refuses absolute paths and `..`."""
    names = [name for name in path.split("/") if name not in ("", ".")]
    if path.startswith("/") or ".." in names or not names:
        raise FileRefused(f"path {path!r} must be relative and stay inside /work")
    return names


def _open_directory(root: int, names: Iterable[str], make: bool = False) -> int:
    """An fd of the directory `names` below `root`, every step without following links (made when `make`)."""
    fd = os.open(".", DIRECTORY, dir_fd=root)
    try:
        for name in names:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            next_fd = os.open(name, DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular(parent: int, name: str, max_bytes: int) -> str | None:
    """A regular file's text (its first max_bytes), or None: missing, a link, not regular, unreadable."""
    try:
        fd = os.open(name, READ, dir_fd=parent)
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


class _Budget:
    """What one read may still take: entries met and bytes returned."""

    def __init__(self) -> None:
        self.entries = self.bytes = 0

    def take(self, entries: int = 0, text: str | None = None) -> None:
        self.entries += entries
        self.bytes += len(text or "")
        if self.entries > MAX_ENTRIES:
            raise FileRefused(f"more than {MAX_ENTRIES} files and directories to read")
        if self.bytes > MAX_TOTAL_BYTES:
            raise FileRefused(f"more than {MAX_TOTAL_BYTES} bytes to read")


def _tree(directory: int, prefix: str, max_bytes: int, budget: _Budget) -> dict[str, str | None]:
    """Every non-directory below `directory` (owned, closed here): path -> text, None where not regular."""
    files: dict[str, str | None] = {}
    stack = [(directory, prefix, 0)]
    try:
        while stack:
            fd, at, depth = stack.pop()
            try:
                with os.scandir(fd) as listing:
                    entries = []
                    for entry in listing:
                        budget.take(entries=1)
                        entries.append((entry.name, entry.is_dir(follow_symlinks=False)))
                for name, is_dir in sorted(entries):
                    path = f"{at}/{name}"
                    if not is_dir:
                        files[path] = _read_regular(fd, name, max_bytes)
                        budget.take(text=files[path])
                    elif depth + 1 > MAX_DEPTH:
                        raise FileRefused(f"directories nested deeper than {MAX_DEPTH} levels below {prefix}")
                    else:
                        stack.append((os.open(name, DIRECTORY, dir_fd=fd), path, depth + 1))
            finally:
                os.close(fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return files


def read(root: int, paths: Iterable[str], max_bytes: int) -> dict[str, str | None]:
    """Path -> text of each file; a directory gives every file below it (sorted paths); None where
    there is no regular file."""
    budget = _Budget()
    files: dict[str, str | None] = {}
    for path in paths:
        *folders, name = parts(path)
        try:
            parent = _open_directory(root, folders)
        except OSError:
            files[path] = None
            continue
        try:
            directory = os.open(name, DIRECTORY, dir_fd=parent)
        except OSError:  # not a directory (or a link to one): a file
            files[path] = _read_regular(parent, name, max_bytes)
            budget.take(entries=1, text=files[path])
        else:
            files.update(_tree(directory, "/".join(parts(path)), max_bytes, budget))
        finally:
            os.close(parent)
    return dict(sorted(files.items()))


@contextlib.contextmanager
def _file_owner(uid: int, gid: int) -> Iterator[None]:
    """This thread creates files as uid:gid (Linux's per-thread fsuid): a root server's own uid 0
    has no mapping in the sandbox's user namespace, where the kernel refuses to create its files."""
    if os.geteuid() != 0:
        yield
        return
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    try:
        yield
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


def _open_regular(parent: int, name: str, mode: int) -> int:
    """An fd to write the regular file `name`; a link, FIFO or socket in its place is removed
    first, never followed or opened for writing (no process of the sandbox runs meanwhile)."""
    try:
        fd = os.open(name, WRITE, mode, dir_fd=parent)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads, a socket
            raise
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
    try:
        os.unlink(name, dir_fd=parent)
    except IsADirectoryError:
        raise FileRefused(f"{name} is a directory") from None
    return os.open(name, WRITE | os.O_EXCL, mode, dir_fd=parent)


def _write_regular(parent: int, name: str, data: bytes, mode: int) -> None:
    fd = _open_regular(parent, name, mode)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def write(root: int, files: Mapping[str, str], executable: Iterable[str], owner: tuple[int, int]) -> None:
    """Writes text files at paths below `root` (parents made), mode 755 for `executable`, else 644."""
    executable = set(executable)
    with _file_owner(*owner):
        for path, text in files.items():
            *folders, name = parts(path)
            try:
                parent = _open_directory(root, folders, make=True)
            except OSError as e:
                raise FileRefused(f"cannot reach the folder of {path} ({e.strerror})") from None
            try:
                _write_regular(parent, name, text.encode(), 0o755 if path in executable else 0o644)
            except OSError as e:  # e.g. no space left on the device
                raise FileRefused(f"cannot write {path} ({type(e).__name__}: {e})") from None
            finally:
                os.close(parent)
