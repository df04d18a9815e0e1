"""A step's compiling seconds apart from its work (agentgym_jax/job/compile_clock.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.job.compile_clock import CompileClock


def test_the_clock_counts_each_new_shape_once_and_only_while_open():
    f = jax.jit(lambda x: jnp.cumsum(jnp.sin(x)) * 3)
    with CompileClock() as clock:
        for n in (3, 4, 5, 3, 4):  # three shapes; the repeats are cache hits
            f(np.ones(n, np.float32)).block_until_ready()
        seconds, programs = clock.lap()
        assert programs == 3 and seconds > 0
        f(np.ones(5, np.float32)).block_until_ready()
        assert clock.lap() == (0.0, 0)  # nothing new since the last lap
        f(np.ones(6, np.float32)).block_until_ready()
        assert clock.lap()[1] == 1
    f(np.ones(7, np.float32)).block_until_ready()  # closed: not counted
    assert clock.programs == 4
