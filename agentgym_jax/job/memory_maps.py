"""A long job's compiled programs against the kernel's limit on a process's memory maps.

XLA's CPU backend loads each kernel of a compiled program as an object of its own (three memory
maps: code, constants, data), and a program stays loaded while its jitted function lives. A
recipe over a 30-layer model compiles hundreds of shapes (decodes by rows and slots, fills,
packed update lengths): SmolLM2's TextCraft recipe held ~50,000 maps by its fifth RL step, and
past Linux's default `vm.max_map_count` (65,530) the next compile fails ("LLVM compilation error:
Cannot allocate memory") and the job aborts. Between steps the job therefore drops every
compiled program once the process nears the limit; the shapes still in use compile again.
"""

from __future__ import annotations

import gc
import pathlib

import jax
from absl import logging


def map_count() -> int | None:
    """This process's memory maps, or None where the system does not list them (no /proc)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def map_limit() -> int | None:
    """The kernel's limit on a process's memory maps (`vm.max_map_count`), or None where unknown."""
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def release_if_near_limit(fraction: float = 0.75, limit: int | None = None) -> bool:
    """Clears JAX's compiled programs if this process holds at least `fraction` of `limit` maps
    (default: the kernel's); True if it did. Call it where nothing runs on another thread."""
    count, limit = map_count(), limit or map_limit()
    if count is None or limit is None or count < fraction * limit:
        return False
    jax.clear_caches()
    gc.collect()
    logging.info("compiled programs dropped: this process held %d memory maps of the kernel's %d (vm.max_map_count); "
                 "%d after, the shapes still in use compile again", count, limit, map_count() or 0)
    return True
