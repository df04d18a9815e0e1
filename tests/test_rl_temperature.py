"""One distribution on both sides: the trainer's log-probs of logits / temperature equal what the
rollout engine stored (the sampler's unfiltered log-probs at that temperature), so `logprob_gap`
measures the real sampler-vs-trainer mismatch: ~0 for a float32 sampler, clearly not for a
bfloat16 one. RL with top-k / top-p or greedy sampling is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollout import framing, maze_url, random_params, task_info  # noqa: F401 (fixtures)

from agentgym_jax.config import ConfigError, load_config_file
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rollout.batch import make_token_batch
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.sampling.sampler import Sampler
from agentgym_jax.train import settings, steps
from tests.updates import update as make_update

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model(framing):  # noqa: F811
    """A random small decoder with weights large enough for peaked, input-dependent logits."""
    config = ModelConfig.small(vocab_size=len(framing.tokenizer))
    return config, random_params(config, 0.15)


def rollout_batch(framing, model, maze_url, task_info, dtype):  # noqa: F811
    rollout = RolloutConfig(group_size=2, max_tokens_per_turn=8, temperature=TEMPERATURE)
    sampler = Sampler.for_decoder(model[0], rollout.sampling_config(framing), max_cache_len=1024, dtype=dtype,
                                  batch_buckets=(4,), chunk_buckets=(128, 256), cache_buckets=(1024,))
    with RolloutEngine(sampler, framing, EnvPool(maze_url), task_info, rollout) as engine:
        trajectories = engine.run(model[1], [3, 4], 3, jax.random.key(1), policy_version=0)
    return make_token_batch(trajectories)


def gap(model, batch, temperature):
    config = make_update(model[0], temperature=temperature, ppo_epochs=2)  # two updates: `prepare` scores the batch
    _, metrics = jax.jit(steps.prepare, static_argnames="config")(model[1], model[1], batch, config=config)
    return float(metrics["logprob_gap"])


@pytest.mark.slow
def test_logprob_gap_is_the_real_sampler_trainer_mismatch(framing, model, maze_url, task_info):  # noqa: F811
    f32 = rollout_batch(framing, model, maze_url, task_info, jnp.float32)
    assert float(np.asarray(f32.loss_mask).sum()) > 20
    matched = gap(model, f32, TEMPERATURE)
    assert matched < 1e-5  # same policy, same temperature: only float32 rounding
    assert gap(model, f32, 1.0) > 100 * max(matched, 1e-6)  # a trainer at temperature 1 is another policy
    bf16 = gap(model, rollout_batch(framing, model, maze_url, task_info, jnp.bfloat16), TEMPERATURE)
    assert bf16 > 1e-3 and bf16 > 100 * max(matched, 1e-6)  # a bfloat16 sampler is a different behaviour policy


def test_rl_temperature_is_the_rollouts_and_filtering_is_refused():
    config = load_config_file("configs/quickstart.py")
    config.rollout.temperature = 0.8
    assert settings.rl_temperature(config) == 0.8
    model = ModelConfig.small()
    assert settings.update(config, model, objective="rl").rl.temperature == 0.8
    for key, value, message in [("top_p", 0.9, "top_p 1.0 .off., got top_k=0, top_p=0.9"),
                                ("top_k", 20, "top_k must be 0"), ("temperature", 0.0, "0 is greedy")]:
        bad = load_config_file("configs/quickstart.py")
        bad.rollout[key] = value
        with pytest.raises(ConfigError, match=message):
            settings.rl_temperature(bad)
