"""The device mesh: axes ("data", "fsdp", "tensor") over all devices of the job.

`data` replicates parameters and splits the batch; `fsdp` splits the batch *and* shards every
large parameter matrix (gathered per layer when used); `tensor` splits attention heads and the
MLP hidden dimension Megatron-style. The batch is sharded over ("data", "fsdp").

A job's devices are either all the trainer's, shared with the sampler, or split between the two
(`split_devices`: the last n devices of each process sample, the others train).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Resolves one -1 entry to the remaining devices; checks the product is `num_devices`."""
    shape = (data, fsdp, tensor)
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh (data, fsdp, tensor) = {shape}: use positive sizes and at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh {shape}: {num_devices} devices are not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh (data, fsdp, tensor) = {shape} needs {math.prod(shape)} devices, but there are {num_devices}"
        )
    return shape


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all devices of all hosts)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def split_devices(sampler_devices: int, devices: Sequence[jax.Device] | None = None,
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """(trainer, sampler) devices of `devices` (default: all devices of all hosts): the last
    `sampler_devices` of each process's devices sample, the others train; both lists hold each
    process's devices together, in process order, like `jax.devices()`."""
    devices = list(devices if devices is not None else jax.devices())
    processes = sorted({d.process_index for d in devices})
    rows = [[d for d in devices if d.process_index == k] for k in processes]
    local = min(len(r) for r in rows)
    if not 0 <= sampler_devices < local:
        raise ValueError(f"{sampler_devices} sampler devices per process: use 0 (share every device) up to "
                         f"{local - 1} (a process has {local} devices and the trainer needs one)")
    cut = [len(r) - sampler_devices for r in rows]
    return [d for r, c in zip(rows, cut) for d in r[:c]], [d for r, c in zip(rows, cut) for d in r[c:]]


def process_mesh(mesh: Mesh, fsdp: int | None = None) -> Mesh:
    """`mesh`'s devices as one ("data", "fsdp", "tensor") mesh per process, stacked on a leading
    "processes" axis: process k's row is its own devices in `mesh`'s order, `fsdp` over all of
    them (or split `fsdp` ways and replicated over "data"). When `mesh` lists each process's devices
    together, in process order, both meshes order the devices alike and moving an array between
    them is a plain reshard."""
    devices = list(mesh.devices.flat)
    rows = [[d for d in devices if d.process_index == k] for k in range(jax.process_count())]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"processes hold different numbers of the mesh's devices: {[len(r) for r in rows]}")
    fsdp = fsdp or len(rows[0])
    return Mesh(np.asarray(rows, dtype=object).reshape(len(rows), -1, fsdp, 1), ("processes", *AXES),
                axis_types=(AxisType.Auto,) * 4)


def local_mesh(mesh: Mesh, fsdp: int | None = None) -> Mesh:
    """This process's row of `process_mesh(mesh, fsdp)`: its devices, `fsdp` over all of them (or
    split `fsdp` ways and replicated over "data")."""
    return Mesh(process_mesh(mesh, fsdp).devices[jax.process_index()], AXES, axis_types=(AxisType.Auto,) * 3)
