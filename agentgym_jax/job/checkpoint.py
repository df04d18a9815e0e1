"""Orbax checkpoints of everything a run needs to continue exactly where it stopped.

A checkpoint holds the train state pytree (params, optimizer state, critic, step, RNG) and a
JSON record of the loop's position (data cursor, horizon stage, anything else the loop needs).
Orbax writes each step into a temporary folder and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact and the torn one is ignored on restore.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves every `every` steps, keeps the last `keep`, restores the latest."""

    def __init__(self, directory: str, every: int, keep: int = 3):
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
        self.every = every
        self._manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    @property
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Saves when `step` is on the interval (or `force`); blocks until it is on disk."""
        if not (force or self.should_save(step)):
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(_without_frozen(state)), meta=ocp.args.JsonSave(meta))
        saved = self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        return saved

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores into the shapes, dtypes and shardings of `abstract_state` (arrays or
        `jax.ShapeDtypeStruct`s); `step=None` means the latest. Frozen parameters (a train state's
        `frozen`: a tuned run's base weights) are not in checkpoints: those of `abstract_state` are
        put back."""
        step = self.latest_step if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        target = jax.tree.map(_abstract, _without_frozen(abstract_state))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        frozen = [x.frozen for x in jax.tree.leaves(abstract_state, is_leaf=_has_frozen) if _has_frozen(x)]
        state = jax.tree.map(lambda x: x.replace(frozen=frozen.pop(0)) if _has_frozen(x) else x, restored["state"],
                             is_leaf=_has_frozen)
        return state, dict(restored["meta"])

    def restore_raw(self, step: int | None = None) -> Any:
        """The saved state as nested lists/dicts of numpy arrays, without a target and whatever
        the saving topology (e.g. the params of a `(TrainState, ref_params)` checkpoint, for
        evaluation on other devices)."""
        step = self.latest_step if step is None else step
        if step not in self.all_steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {self._manager.directory}; steps: {self.all_steps}")
        # A reader that knows both items' formats, so it reads the step as the manager wrote it
        # (step metadata included) and can restore the state without a target.
        reader = ocp.CheckpointManager(
            self._manager.directory, item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(create=False),
        )
        try:
            tree = reader.item_metadata(step)["state"].tree
            to_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            return reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=to_numpy)))["state"]
        finally:
            reader.close()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _has_frozen(x: Any) -> bool:
    return hasattr(x, "frozen") and hasattr(x, "replace")


def _without_frozen(tree: Any) -> Any:
    """`tree` with every train state's frozen parameters left out (they are not trained: a
    checkpoint of a LoRA run holds its adapters, not the base model)."""
    return jax.tree.map(lambda x: x.replace(frozen={}) if _has_frozen(x) else x, tree, is_leaf=_has_frozen)


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
