"""Behaviour cloning on trajectories: the same token batches and masks as RL, NLL loss.

Used as the warm start before RL (on oracle demonstrations) and by AgentEvol, each phase from a
fresh optimizer whose schedule spans the phase (`BehaviourCloning`). Batches group rows of similar
length and pad to their own bucket (`length_grouped_batches`), so the jitted step compiles once
per bucket, not per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from agentgym_jax.parallel.distributed import is_writer, rows_from_host
from agentgym_jax.parallel.partition import batch_sharding
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.batch import bucket, length_grouped_batches, make_token_batch
from agentgym_jax.rollout.packing import pack_groups
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import settings
from agentgym_jax.train.state import TrainState, make_optimizer
from agentgym_jax.train.steps import StepFns, UpdateConfig, make_step_fns, train_state_shardings


def sft_num_updates(num_trajectories: int, batch_size: int, epochs: int) -> int:
    """Optimizer updates of `sft_train` (what its learning-rate schedule should span)."""
    return epochs * -(-num_trajectories // batch_size)


def sft_train(
    state: TrainState,
    trajectories: Sequence[Trajectory],
    config: UpdateConfig,
    *,
    batch_size: int,
    epochs: int,
    seed: int,
    length_window: int = 8,
    progress: bool = True,
    mesh: Mesh | None = None,
    step_fns: StepFns | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """`epochs` passes over `trajectories` in seeded shuffled order, batches sorted by length within
    runs of `length_window` batches (1: unsorted); metrics of every update.

    With a `mesh`, the state is placed by `train_state_shardings` and batch rows are split over
    ("data", "fsdp") (batches padded with empty rows to a multiple of that split; with several
    processes, every process holds all `trajectories` and places its own rows). `step_fns`
    (`make_step_fns` for the same config and mesh) reuses compiled updates across calls; they
    compile once only for states with the same optimizer object (`TrainState.tx` is static).
    """
    if not trajectories:
        raise ValueError("SFT needs at least one trajectory")
    shardings = None if mesh is None else train_state_shardings(state, mesh)
    if shardings is not None:
        state = jax.device_put(state, shardings)
    step_fns = step_fns or make_step_fns(config, mesh, shardings)
    rows_per_batch = step_fns.padded_rows(batch_size)
    # Shared prefixes (the environment's instruction) once per unit: the rows one device runs per micro-batch.
    rows_per_unit = rows_per_batch // (config.batching.num_microbatches * step_fns.row_shards)
    lengths = [len(t.token_ids) for t in trajectories]
    rng = np.random.default_rng(seed)
    history = []
    with Progress("sft", sft_num_updates(len(trajectories), batch_size, epochs), "batch", enabled=progress) as bar:
        for _ in range(epochs):
            for picked in length_grouped_batches(lengths, batch_size, rng, length_window):
                rows = [trajectories[i] for i in picked]
                seq_len = bucket(max(lengths[i] for i in picked))
                batch = make_token_batch(rows, seq_len=seq_len, batch_size=rows_per_batch)  # pads with id 0, inside any vocabulary
                if config.batching.shared_prefix and rows_per_unit > 1:
                    units = batch.replace(group_ids=np.arange(rows_per_batch, dtype=np.int32) // rows_per_unit)
                    batch = pack_groups(units, rows_per_unit, num_units=rows_per_batch // rows_per_unit)
                if mesh is not None:
                    batch = rows_from_host(batch, batch_sharding(mesh))
                state, metrics = step_fns.sft_update(state, batch)
                history.append({k: float(v) for k, v in metrics.items()})
                bar.update(nll=history[-1]["nll"])
    return state, history


class BehaviourCloning:
    """Phases of behaviour cloning (`sft.batch_size`, `sft.lr`, `sft.length_window`), each from a
    fresh optimizer whose schedule spans exactly that phase's updates (a cosine decay ends at its
    last update): the RL warm start, and each AgentEvol iteration.

    `TrainState.tx` is static, so each schedule length gets its own optimizer object and compiled
    update; phases with the same number of updates (and a constant learning rate, where the
    length does not matter) share them.
    """

    def __init__(self, config: ml_collections.ConfigDict, update: UpdateConfig, mesh: Mesh):
        self._config, self._update, self._mesh = config, update, mesh
        self._optimizers: dict[int, optax.GradientTransformation] = {}
        self._step_fns: dict[int, StepFns] = {}

    def fresh_state(self, params: Any, *, rows: int, epochs: int, frozen: Any = None) -> tuple[TrainState, StepFns]:
        """A placed train state over `params` (and `frozen`) for `epochs` passes over `rows` rows, and its update."""
        config = self._config
        updates = sft_num_updates(rows, config.sft.batch_size, epochs)
        key = 0 if config.optim.lr_schedule == "constant" else updates
        if key not in self._optimizers:
            self._optimizers[key] = make_optimizer(settings.optim(config, updates, lr=config.sft.lr))
        state = TrainState.create(params, self._optimizers[key], jax.random.PRNGKey(config.seed + 2), frozen=frozen)
        shardings = train_state_shardings(state, self._mesh)
        if key not in self._step_fns:
            self._step_fns[key] = make_step_fns(self._update, self._mesh, shardings)
        return jax.device_put(state, shardings), self._step_fns[key]

    def train(self, params: Any, trajectories: Sequence[Trajectory], *, epochs: int, seed: int,
              frozen: Any = None) -> tuple[TrainState, list[dict[str, float]]]:
        """`epochs` of behaviour cloning from `params` on `trajectories` (`sft_train`, shuffled by `seed`)."""
        state, step_fns = self.fresh_state(params, rows=len(trajectories), epochs=epochs, frozen=frozen)
        return sft_train(state, trajectories, self._update, batch_size=self._config.sft.batch_size, epochs=epochs,
                         seed=seed, mesh=self._mesh, step_fns=step_fns, length_window=self._config.sft.length_window,
                         progress=is_writer())
