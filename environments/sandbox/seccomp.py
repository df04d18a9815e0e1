"""The seccomp filter every sandboxed process runs under: system calls an agent never needs fail.

A classic BPF program (what `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)` takes), assembled here
from the kernel's ABI: the syscall numbers of x86_64 and aarch64 (checked against libseccomp's
tables in `tests/test_sandbox.py`). Refused with EPERM: loading BPF, perf events, the kernel
keyring, tracing other processes and their memory, every mount call, kexec and kernel modules,
userfaultfd, io_uring, entering namespaces and new user namespaces (`clone`/`unshare` with
CLONE_NEWUSER), chroot, swap, reboot, accounting, quotas, file handles and the kernel log.
`clone3` fails with ENOSYS (its flags sit in memory a filter cannot read), so libc falls back
to `clone`, whose flags it can. A system call of another ABI (x32, or i386 through `int 0x80`)
fails whole. The runner installs the program on itself after its own set-up (`runner.py`).
"""

from __future__ import annotations

import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64 only: the x32 ABI's numbers
REFUSED = {  # name -> (x86_64, aarch64)
    "bpf": (321, 280), "perf_event_open": (298, 241), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "setns": (308, 268), "chroot": (161, 51),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "open_by_handle_at": (304, 265), "syslog": (103, 116),
}
CLONE, UNSHARE, CLONE3 = (56, 220), (272, 97), (435, 435)  # (x86_64, aarch64)
CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38

# classic BPF opcodes and seccomp's return values (linux/filter.h, linux/seccomp.h)
LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
JUMP_EQUAL, JUMP_AT_LEAST, JUMP_ANY_BIT = 0x15, 0x35, 0x45  # BPF_JMP | BPF_JEQ / BPF_JGE / BPF_JSET, BPF_K
RETURN = 0x06  # BPF_RET | BPF_K
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
NR_OFFSET, ARCH_OFFSET, ARG0_OFFSET = 0, 4, 16  # fields of struct seccomp_data (arg 0's low word, little-endian)


def _op(code: int, k: int = 0, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def _refuse(nr: int, errno: int = EPERM) -> bytes:
    """If the syscall is `nr`: fail it with `errno`; else go on."""
    return _op(JUMP_EQUAL, nr, 0, 1) + _op(RETURN, ERRNO | errno)


def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (this one by default) as `struct sock_filter`s; None for an
    architecture without a table here."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    which = tuple(AUDIT_ARCH).index(machine)
    code = _op(LOAD_WORD, ARCH_OFFSET) + _op(JUMP_EQUAL, AUDIT_ARCH[machine], 1, 0) + _op(RETURN, ERRNO | EPERM)
    code += _op(LOAD_WORD, NR_OFFSET)
    if machine == "x86_64":
        code += _op(JUMP_AT_LEAST, X32_SYSCALL_BIT, 0, 1) + _op(RETURN, ERRNO | EPERM)
    for numbers in REFUSED.values():
        code += _refuse(numbers[which])
    code += _refuse(CLONE3[which], ENOSYS)
    code += (_op(JUMP_EQUAL, CLONE[which], 1, 0) + _op(JUMP_EQUAL, UNSHARE[which], 0, 3)  # neither: allow
             + _op(LOAD_WORD, ARG0_OFFSET) + _op(JUMP_ANY_BIT, CLONE_NEWUSER, 0, 1) + _op(RETURN, ERRNO | EPERM))
    return code + _op(RETURN, ALLOW)
