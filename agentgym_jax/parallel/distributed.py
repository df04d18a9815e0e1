"""Multi-host start-up: call `initialize_distributed()` first thing in a job, before any JAX work.

It calls `jax.distributed.initialize()` only when the job really runs as several processes (an
explicit coordinator address, a SLURM step with several tasks, Open MPI with several ranks, or a
multi-host TPU pod) and does nothing on one host, so the same entry point runs on a laptop, a
SLURM GPU cluster and a TPU pod. On CPU, cross-process collectives go through gloo (JAX's default
for `jax_cpu_collectives_implementation`; env JAX_CPU_COLLECTIVES_IMPLEMENTATION overrides it).

The rest are the few cross-process operations a job needs: its share of a list, host objects
gathered from every process, and global arrays built from per-process rows.
"""

from __future__ import annotations

import math
import os
import urllib.request
from collections.abc import Mapping

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from agentgym_jax.parallel.mesh import AXES, local_mesh, process_mesh

_TPU_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


def _count(value: str | None) -> int:
    """Number of entries in a comma-separated host list ('' or None -> 0)."""
    return len([v for v in (value or "").split(",") if v.strip()])


def tpu_pod_workers() -> int:
    """Workers of this Cloud TPU slice from the VM metadata server (0 off a TPU VM or when unreachable)."""
    if not any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")):
        return 0
    request = urllib.request.Request(_TPU_METADATA, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return _count(response.read().decode())
    except OSError:
        return 0


def multi_process_reason(env: Mapping[str, str] | None = None, tpu_workers: int | None = None) -> str | None:
    """Why this job needs `jax.distributed` (a short description), or None on a single host."""
    env = os.environ if env is None else env
    if _first(env, "JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS"):
        return "coordinator address set"
    if int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or 1) > 1:
        return f"SLURM step with {env.get('SLURM_NTASKS') or env.get('SLURM_NPROCS')} tasks"
    if int(env.get("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return f"Open MPI with {env['OMPI_COMM_WORLD_SIZE']} ranks"
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "multi-slice TPU"
    hosts = _count(_first(env, "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"))
    if hosts == 0:
        hosts = tpu_pod_workers() if tpu_workers is None else tpu_workers
    if hosts > 1:
        return f"TPU pod with {hosts} hosts"
    return None


def initialize_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Joins the multi-process job if there is one; returns whether JAX runs distributed.

    Explicit settings (`JAX_COORDINATOR_ADDRESS` or `COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` or
    `NUM_PROCESSES`, `JAX_PROCESS_ID` or `PROCESS_ID`) win; whatever is unset, JAX detects from
    SLURM, Open MPI or the TPU metadata.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return True
    reason = multi_process_reason(env)
    if reason is None:
        return False
    num_processes = _first(env, "JAX_NUM_PROCESSES", "NUM_PROCESSES")
    process_id = _first(env, "JAX_PROCESS_ID", "PROCESS_ID")
    logging.info("initialising jax.distributed (%s)", reason)
    jax.distributed.initialize(
        coordinator_address=_first(env, "JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS"),
        num_processes=None if num_processes is None else int(num_processes),
        process_id=None if process_id is None else int(process_id),
    )
    return True


def share_bounds(num_items: int, processes: int, index: int, what: str, even: bool = True) -> tuple[int, int]:
    """[start, end) of process `index`'s share: the `index`-th of `processes` consecutive
    slices, so the shares in process order are the items in order (global row order equals
    one-process row order). With `even`, a count that does not divide is an error (global
    arrays need equal shares)."""
    if even and num_items % processes:
        raise ValueError(f"{what}: {num_items} do not split evenly over {processes} processes; use a multiple of {processes}")
    bounds = np.linspace(0, num_items, processes + 1).round().astype(int)  # [processes + 1]
    return int(bounds[index]), int(bounds[index + 1])


def process_share(items: Sequence[Any], what: str, even: bool = True) -> tuple[list[Any], int]:
    """This process's contiguous share of `items` (`share_bounds`) and the index of its first item."""
    start, end = share_bounds(len(items), jax.process_count(), jax.process_index(), what, even)
    return list(items[start:end]), start


def gather_objects(obj: Any) -> list[Any]:
    """`obj` (JSON-serialisable) of every process, in process order; every process must call it."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))  # [processes, 1]
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[: data.size] = data
    everything = multihost_utils.process_allgather(padded)  # [processes, max_size]
    return [json.loads(bytes(row[: int(size)]).decode()) for row, size in zip(everything, sizes[:, 0])]


def broadcast_object(obj: Any) -> Any:
    """Process 0's `obj` (JSON-serialisable) on every process."""
    return gather_objects(obj if jax.process_index() == 0 else None)[0]


def barrier(name: str) -> None:
    """Waits until every process reached the barrier `name` (no-op on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def is_writer() -> bool:
    """Whether this process writes the job's shared outputs (metrics, reports): process 0."""
    return jax.process_index() == 0


def rows_from_processes(tree: Any, sharding: NamedSharding) -> Any:
    """Global arrays whose leading (row) dim is every process's local rows in process order.

    Each leaf is this process's `[local_rows, ...]` host data; all processes give the same
    local row count (`jax.make_array_from_process_local_data`).
    """
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def rows_from_host(tree: Any, sharding: NamedSharding) -> Any:
    """Global arrays from host data that every process holds in full (each places its own shards)."""
    def place(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, tree)


def to_local(tree: Any, mesh: jax.sharding.Mesh, shardings: Any) -> Any:
    """A copy of global arrays (laid out over `mesh`) on this process's devices, laid out by
    `shardings` (a pytree of `NamedSharding`s over one mesh of this process's devices, `fsdp` over
    all of them, matching `tree`): what a process-local sampler reads. Every process calls it
    with the same `shardings`, each on its own devices.

    On `mesh`'s own devices of this process (`local_mesh(mesh)`: the sampler shares the trainer's
    devices): one reshard to that layout on every process's devices at once (over
    `process_mesh(mesh)`, replicated over "processes"), so each device receives its local shard
    only, never a whole replica. On one process: `tree` unchanged.

    On devices of its own (disjoint from `mesh`'s; XLA reshards only within one device set): the
    same reshard to a layout over this process's devices of `mesh` whose shards are the target's
    (each split g = gcd(m, n) ways, for m devices of `mesh` and n target devices of the process),
    then copied shard for shard, device to device, onto the target devices, and there split the
    rest of the way (when g < n). Never through the host; a fresh copy, whatever becomes of `tree`.
    """
    target = jax.tree.leaves(shardings)[0].mesh
    own = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if set(own) == set(target.devices.flat):
        return tree if jax.process_count() == 1 else _localized(tree, mesh, shardings)
    if target.shape["data"] != 1 or target.shape["tensor"] != 1:
        raise ValueError(f"to_local copies onto a mesh with fsdp over all its devices, got {dict(target.shape)}")
    g = math.gcd(len(own), target.size)
    staged = _localized(tree, mesh, _on(local_mesh(mesh, fsdp=g), shardings), fsdp=g)
    landed = jax.device_put(staged, _on(Mesh(target.devices.reshape(-1, g, 1), AXES, axis_types=target.axis_types), shardings))
    return landed if g == target.size else _reshard(landed, shardings)


def _reshard(tree: Any, shardings: Any) -> Any:
    """`tree` laid out by `shardings` over the same devices, moved device to device: a jitted
    identity where both list the devices alike (`jax.device_put` would go through the host on one
    process), else `jax.device_put` (which reorders them first)."""
    before, after = jax.tree.leaves(tree)[0].sharding, jax.tree.leaves(shardings)[0]
    if list(before.mesh.devices.flat) == list(after.mesh.devices.flat):
        return jax.jit(_identity, out_shardings=shardings)(tree)
    return jax.device_put(tree, shardings)


def _identity(tree: Any) -> Any:
    return tree


def _on(mesh: jax.sharding.Mesh, shardings: Any) -> Any:
    """`shardings`' specs over `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def _localized(tree: Any, mesh: jax.sharding.Mesh, shardings: Any, fsdp: int | None = None) -> Any:
    """`tree` (global arrays over `mesh`) laid out by `shardings` (over this process's row of
    `process_mesh(mesh, fsdp)`), on every process at once: arrays of this process's devices."""
    copied = _reshard(tree, _on(process_mesh(mesh, fsdp), shardings))

    def localize(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        by_device = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [by_device[d] for d in sharding.mesh.devices.flat])

    return jax.tree.map(localize, copied, shardings)
