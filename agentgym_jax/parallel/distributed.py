"""Multi-host start-up: call `initialize_distributed()` first thing in a job, before any JAX work.

It calls `jax.distributed.initialize()` only when the job really runs as several processes (an
explicit coordinator address, a SLURM step with several tasks, Open MPI with several ranks, or a
multi-host TPU pod) and does nothing on one host, so the same entry point runs on a laptop, a
SLURM GPU cluster and a TPU pod.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Mapping

from absl import logging
import jax

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
