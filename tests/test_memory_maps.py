"""A long job drops its compiled programs before the process passes the kernel's map limit
(agentgym_jax/job/memory_maps.py): XLA's CPU kernels are three memory maps each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.job import memory_maps


def test_compiled_programs_are_dropped_only_near_the_map_limit():
    if memory_maps.map_count() is None or memory_maps.map_limit() is None:
        pytest.skip("no /proc: the system lists no memory maps")
    f = jax.jit(lambda x: jnp.tanh(x) * jnp.exp(-x) + x.sum())
    for n in range(1, 9):
        f(jnp.ones(n)).block_until_ready()
    assert f._cache_size() == 8
    count = memory_maps.map_count()
    assert not memory_maps.release_if_near_limit(limit=2 * count)  # half the limit: every program kept
    assert f._cache_size() == 8
    assert memory_maps.release_if_near_limit(limit=count)  # at the limit: dropped, maps given back
    assert f._cache_size() == 0
    assert memory_maps.map_count() < count
    np.testing.assert_allclose(f(jnp.ones(3)), np.full(3, np.tanh(1) * np.exp(-1) + 3.0), rtol=1e-6)  # compiled again
