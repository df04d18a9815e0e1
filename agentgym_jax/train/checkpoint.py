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
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        saved = self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        return saved

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores into the shapes, dtypes and shardings of `abstract_state` (arrays or
        `jax.ShapeDtypeStruct`s); `step=None` means the latest."""
        step = self.latest_step if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        target = jax.tree.map(_abstract, abstract_state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["meta"])

    def restore_raw(self, step: int | None = None) -> Any:
        """The saved state as plain nested lists/dicts of arrays, without a target (e.g. only the
        params of a `(TrainState, ref_params)` checkpoint, for evaluation)."""
        step = self.latest_step if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))["state"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
