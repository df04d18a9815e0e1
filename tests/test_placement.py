"""Where the sampler and the trainer run (`rollout.sampler_devices`): sharing every device, or
the sampler on the last n devices of each process and the trainer on the rest, the weights
copied over after each update (`job/setup.py`, `parallel/distributed.to_local`).

On 8 simulated CPU devices, and with 2 real processes x 4 devices on 127.0.0.1.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax.config import ConfigError
from agentgym_jax.job import settings, setup
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.parallel import distributed
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler
from configs import quickstart
from test_multihost import Processes
from test_sampler import count_compilations

MODEL = ModelConfig.small("qwen2", vocab_size=128, hidden_size=64, intermediate_size=128)


def _config(sampler_devices: int, tmp_path=None, compute: str = "bfloat16", **mesh):
    config = quickstart.get_config()
    config.rollout.sampler_devices = sampler_devices
    config.model.compute_dtype = compute
    config.mesh.update(mesh)
    if tmp_path is not None:
        config.workdir = str(tmp_path / "job")
    return config


def _ids(mesh: jax.sharding.Mesh) -> list[int]:
    return [d.id for d in mesh.devices.flat]


def test_the_trainer_and_the_sampler_split_the_devices_or_share_them_all(tmp_path):
    with setup.open_job(_config(4, tmp_path), servers=False) as job:
        trainer, sampler = _ids(job.mesh), _ids(job.sampler_mesh)
    assert trainer == [0, 1, 2, 3] and sampler == [4, 5, 6, 7]  # disjoint, all 8: the last 4 sample
    assert dict(job.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}  # fsdp=-1 over the trainer's 4
    assert dict(job.sampler_mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}

    split = _config(2, data=2)
    assert _ids(setup.trainer_mesh(split)) == list(range(6)) and _ids(setup.sampler_mesh(split)) == [6, 7]
    assert dict(setup.trainer_mesh(split).shape) == {"data": 2, "fsdp": 3, "tensor": 1}

    with setup.open_job(_config(0, tmp_path), servers=False) as job:  # today's placement: one mesh for both
        assert job.mesh == job.sampler_mesh == make_mesh(1, -1, 1)
    without_key = _config(0)
    del without_key.rollout["sampler_devices"]  # configs from before the key
    assert setup.sampler_mesh(without_key) == setup.trainer_mesh(without_key) == make_mesh(1, -1, 1)


@pytest.mark.parametrize("sampler_devices, mesh, message", [
    (-1, {}, r"rollout.sampler_devices=-1: -1 sampler devices per process: use 0 \(share every device\) up to 7"),
    (8, {}, r"rollout.sampler_devices=8: 8 sampler devices per process: .* \(a process has 8 devices and the trainer needs one\)"),
    (3, {"data": 2}, r"config.mesh: mesh \(2, -1, 1\): 5 devices are not divisible by 2 \(rollout.sampler_devices=3"),
    (4, {"tensor": 8, "fsdp": 1}, r"config.mesh: .* needs 8 devices, but there are 4 \(rollout.sampler_devices=4"),
])
def test_a_placement_that_cannot_run_is_a_one_line_config_error(tmp_path, sampler_devices, mesh, message):
    config = _config(sampler_devices, tmp_path, **mesh)
    for build in (setup.trainer_mesh, lambda c: setup.open_job(c, servers=False).__enter__()):
        with pytest.raises(ConfigError, match=message) as error:
            build(config)
        assert "\n" not in str(error.value)


def test_the_sampler_s_weights_are_a_compute_dtype_copy_on_its_own_devices_that_outlives_the_params():
    config = _config(4)
    job = setup.Job(None, setup.trainer_mesh(config), setup.sampler_mesh(config), config.env, {}, {})
    params = setup.initial_params(config, MODEL, job.mesh, jax.random.key(0), value_head=True)
    expected = {k: jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), v) for k, v in params.items() if k != "value_head"}
    weights = setup.local_policy(config, job, params)
    jax.tree.map(lambda x: x.delete(), params)  # what the trainer's donating update does to them
    sampler_devices = set(job.sampler_mesh.devices.flat)
    for path, w in jax.tree_util.tree_leaves_with_path(weights):
        assert w.sharding.device_set == sampler_devices and w.dtype == jnp.bfloat16, path
    sampler = Sampler.sharded_decoder(MODEL, SamplingConfig(max_new_tokens=4), job.sampler_mesh, max_cache_len=64,
                                      dtype="bfloat16")
    shards = jax.tree.map(lambda w, s: w.sharding.is_equivalent_to(s, w.ndim), weights, sampler.shardings.params)
    assert all(jax.tree.leaves(shards))  # the sampler's own layout: it reads them without a copy
    assert {s.data.shape for s in weights["embed"]["embedding"].addressable_shards} == {(32, 64)}  # vocab over 4
    assert jax.tree.structure(weights) == jax.tree.structure(expected)
    for w, e in zip(jax.tree.leaves(weights), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(w), e)  # exact: a cast and a copy, nothing else

    again = setup.initial_params(config, MODEL, job.mesh, jax.random.key(1), value_head=True)
    with count_compilations() as compiled:  # after every update: the same copy, compiled once
        setup.local_policy(config, job, again)
    assert compiled == []

    shared = _config(0)
    params = setup.initial_params(shared, MODEL, make_mesh(), jax.random.key(0), value_head=True)
    kept = setup.local_policy(shared, setup.Job(None, make_mesh(), setup.sampler_mesh(shared), shared.env, {}, {}), params)
    assert kept is params  # sharing one process's devices: as today, the sampler casts its own copy


@pytest.mark.parametrize("trainer, sampler", [(4, 4), (6, 2), (5, 3)])
def test_the_copy_onto_other_devices_moves_shards_device_to_device_never_through_the_host(monkeypatch, trainer, sampler):
    """`jax.device_put` across disjoint device sets fetches the whole array to the host unless the
    shards already match; `to_local` stages a matching layout first (gcd(5, 3) = 1: whole copies)."""
    fetched = []
    value = jax_array.ArrayImpl._value  # the one place a jax.Array is read whole onto the host
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(lambda x: (fetched.append(x.shape), value.fget(x))[1]))
    devices = jax.devices()
    source, target = make_mesh(1, -1, 1, devices[:trainer]), make_mesh(1, -1, 1, devices[trainer:])
    host = np.arange(60 * 6, dtype=np.float32).reshape(60, 6)
    x = jax.device_put(host, NamedSharding(source, P("fsdp")))
    shardings = {"w": NamedSharding(target, P("fsdp")), "b": NamedSharding(target, P())}

    plain = jax.device_put(x, shardings["w"])
    assert len(fetched) == (0 if trainer == sampler else 1)  # the host round trip the staging avoids
    fetched.clear()
    copy = distributed.to_local({"w": x, "b": x}, source, shardings)
    assert fetched == []
    x.delete()
    for name, s in shardings.items():
        assert copy[name].sharding == s
        np.testing.assert_array_equal(np.asarray(copy[name]), host)
    np.testing.assert_array_equal(np.asarray(plain), host)


def test_a_sampler_on_its_own_devices_samples_what_the_shared_one_samples(tmp_path):
    framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp_path, ["go north", "take the key"], 300)))
    model = ModelConfig.small("qwen2", vocab_size=len(framing.tokenizer), hidden_size=64, intermediate_size=128)
    turns = {}
    for n in (0, 4):
        config = _config(n, compute="float32")
        config.rollout.update(dict(max_cache_len=64, max_tokens_per_turn=6))
        job = setup.Job(None, setup.trainer_mesh(config), setup.sampler_mesh(config), config.env, {}, {})
        params = setup.initial_params(config, model, job.mesh, jax.random.key(0), value_head=False)
        sampler = setup.make_sampler(config, model, framing, settings.rollout(config, temperature=0.0))
        weights = sampler.sampling_params(setup.local_policy(config, job, params))
        state, turn = sampler.generate(weights, sampler.prefill(weights, [[5, 6, 7], [8, 9]]), jax.random.key(1))
        assert state.cache.k.sharding.device_set == set(job.sampler_mesh.devices.flat)
        turns[n] = turn
    assert turns[4].count.tolist() == turns[0].count.tolist()
    np.testing.assert_array_equal(turns[4].tokens, turns[0].tokens)  # greedy: the same tokens
    np.testing.assert_allclose(turns[4].logprobs, turns[0].logprobs, atol=1e-5)


# Each process (4 devices, the last 2 sample): its meshes, its copy of the weights and a greedy turn.
TWO_PROCESSES = """
import json, jax, numpy as np
from jax.experimental import multihost_utils
from agentgym_jax.job import settings, setup
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler
from configs import quickstart

config = quickstart.get_config()
config.workdir = "{workdir}"
config.rollout.sampler_devices = 2
model = ModelConfig.small("qwen2", vocab_size=128, hidden_size=64, intermediate_size=128)
with setup.open_job(config, servers=False) as job:
    params = setup.initial_params(config, model, job.mesh, jax.random.key(0), value_head=True)
    full = multihost_utils.process_allgather({{k: v for k, v in params.items() if k != "value_head"}}, tiled=True)
    weights = setup.local_policy(config, job, params)
    jax.tree.map(lambda x: x.delete(), params)
    sampler = Sampler.sharded_decoder(model, SamplingConfig(max_new_tokens=4, temperature=0.0), job.sampler_mesh,
                                      max_cache_len=64, dtype="float32")
    state, turn = sampler.generate(weights, sampler.prefill(weights, [[1, 2, 3], [4, 5]]), jax.random.key(1))
    print("RESULT " + json.dumps({{
        "trainer": [d.id for d in job.mesh.devices.flat], "sampler": [d.id for d in job.sampler_mesh.devices.flat],
        "local": [d.id for d in jax.local_devices()],
        "weights_on": sorted({{d.id for x in jax.tree.leaves(weights) for d in x.sharding.device_set}}),
        "equal": all(np.array_equal(np.asarray(w), f) for w, f in zip(jax.tree.leaves(weights), jax.tree.leaves(full))),
        "tokens": turn.tokens.tolist(),
    }}))
"""


@pytest.mark.slow
def test_on_two_processes_each_samples_on_its_own_last_devices_and_the_trainer_spans_the_rest(tmp_path):
    script = TWO_PROCESSES.format(workdir=tmp_path / "job")
    with Processes([sys.executable, "-c", script], tmp_path / "logs", 2) as job:
        logs = job.wait(300)
    results = [json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[7:]) for log in logs]
    p0, p1 = results
    assert p0["trainer"] == p1["trainer"] == p0["local"][:2] + p1["local"][:2]  # in process order
    for r in results:
        assert r["sampler"] == r["weights_on"] == r["local"][2:] and r["equal"]  # float32 here: the params exactly

    # One process, every device shared: the same params sample the same greedy turn.
    config = _config(0, compute="float32")
    params = setup.initial_params(config, MODEL, make_mesh(), jax.random.key(0), value_head=True)
    sampler = Sampler.sharded_decoder(MODEL, SamplingConfig(max_new_tokens=4, temperature=0.0), make_mesh(),
                                      max_cache_len=64, dtype="float32")
    weights = sampler.sampling_params(params)
    _, turn = sampler.generate(weights, sampler.prefill(weights, [[1, 2, 3], [4, 5]]), jax.random.key(1))
    assert p0["tokens"] == p1["tokens"] == turn.tokens.tolist()
