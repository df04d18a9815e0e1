"""Orbax checkpoints: exact round trip, retention, and a save killed half-way loses nothing."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.job.checkpoint import Checkpointer


def _state(seed: int):
    key = jax.random.PRNGKey(seed)
    return {
        "params": {"w": jax.random.normal(key, (4, 3)), "b": jnp.arange(3.0)},
        "opt": {"mu": jnp.full((4, 3), float(seed), jnp.bfloat16)},
        "step": jnp.asarray(seed, jnp.int32),
        "rng": jax.random.split(key)[0],
    }


def test_round_trip_is_exact_and_keeps_the_last_k(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=2, keep=2)
    for step in range(1, 8):
        ckpt.save(step, _state(step), {"cursor": step * 10, "stage": step // 3})
    assert ckpt.all_steps == [4, 6]
    state, meta = ckpt.restore(_state(0))
    assert meta == {"cursor": 60, "stage": 2}
    jax.tree.map(np.testing.assert_array_equal, state, _state(6))
    assert state["opt"]["mu"].dtype == jnp.bfloat16
    ckpt.close()


def test_restore_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(str(tmp_path), every=1).restore(_state(0))


def test_invalid_interval_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="every=0"):
        Checkpointer(str(tmp_path), every=0)


def test_sigkill_during_saves_leaves_a_restorable_checkpoint(tmp_path):
    """A writer saving large states is SIGKILLed at a random moment; the latest complete
    checkpoint restores exactly."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, sys
        from agentgym_jax.job.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r}, every=1, keep=100)
        for step in range(1, 1000):
            state = {{"w": jnp.full((512, 512), float(step))}}
            ckpt.save(step, state, {{"step": step}})
            print(step, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    for _ in range(3):
        proc.stdout.readline()  # three completed saves
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = Checkpointer(str(tmp_path), every=1, keep=100)
    state, meta = ckpt.restore({"w": jnp.zeros((512, 512))})
    assert meta["step"] >= 3
    np.testing.assert_array_equal(state["w"], np.full((512, 512), float(meta["step"])))
