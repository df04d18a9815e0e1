r"""Per-device memory of a config's jitted steps at its real model shape, compiled ahead of time.

    python bench/scale.py --config=configs/textcraft_grpo.py               # Qwen2.5-7B, 8 simulated devices
    python bench/scale.py --config=configs/babyai_scalinginter.py
    python bench/scale.py --config=configs/textcraft_grpo.py:qwen2.5-1.5b --num_devices=1
    python bench/scale.py --config=configs/textcraft_grpo.py --config.model.num_layers=2   # a quick look
    python bench/scale.py --config=configs/textcraft_grpo.py --run    # on an accelerator: also measure

Without a checkpoint or an allocated weight: the train state is `jax.eval_shape`d, every argument
is a `jax.ShapeDtypeStruct` carrying its sharding over the config's mesh, and each step is
`jax.jit(...).lower(...).compile()`d the way the RL job builds it (`train.steps.make_step_fns`,
`Sampler.sharded_decoder`), for `--num_devices` devices (default 8; simulated CPU devices, the
script sets XLA_FLAGS before JAX starts). The steps, in the order an RL step runs them:

- `append`: the sampler writes a `--chunk`-token chunk (a prompt, an observation) for every
  episode into a full-length KV cache (`rollout.max_cache_len` slots), in pieces of as many
  tokens a row as fit `rollout.fill_tokens` over every row (one piece compiled); with continuous
  batching (`rollout.num_slots`), `fill`: as many rows at a time as fit in it;
- `decode`: the sampler samples one turn (`rollout.max_tokens_per_turn` tokens) over that cache;
- `prepare`: log-probs of the policy and the reference, advantages, over the whole batch;
- `rl_update`: `ppo_epochs` x `num_minibatches` optimizer updates (the state donated).

Batch: `batch_tasks * group_size` episodes, each of the longest length: `rollout.max_cache_len`
tokens, padded to the job's length bucket (`--seq` overrides). For each step it prints the
per-device argument, output, aliased (donated) and temporary bytes from
`compiled.memory_analysis()`, the per-device bytes of what the job keeps live beside the step
(`resident`: the train state and the reference while sampling, the optimizer state during
`prepare`, the reference during the update), their sum (`peak`), the compile time, and that peak
as a share of the HBM of an H100 80 GB, an H200 141 GB and a TPU v5p chip (95 GB). A device fits
when the peak is at most 90% of its HBM (the 10% headroom covers what XLA's CPU buffer
assignment leaves out, see bench/README.md). With a 16-bit KV cache, compiled on the CPU, the
sampler's steps count the temp of the same step over a float32 cache: the CPU has no bfloat16
scatter and converts the whole cache to float32 around each write, which an accelerator does
not (`float32_cache_twins`); `cpu_temp` is the as-compiled temp. Last line:
`summary: config=<name> model=<shape> seq=<max tokens> max_device_gib=<x> fits_h100_80g=<0|1>`.

`--run` then allocates random weights at the shape on the mesh's devices, runs each compiled
step once (a sampled turn is the append and the decode) and prints its time and the devices'
peak memory so far (`device.memory_stats()`, where the backend reports it; the CPU does not).
"""

from __future__ import annotations

import os
import sys


def _flag(argv: list[str], name: str, default: str) -> str:
    """The value of `--name=value` in argv (absl parses the flags only after JAX is imported)."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), default)


if __name__ == "__main__":  # before JAX is imported: the simulated devices
    _devices_flag = f"--xla_force_host_platform_device_count={_flag(sys.argv, 'num_devices', '8')}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_devices_flag}".strip()
    if "--run" not in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: leave any accelerator alone

import functools  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.config import ConfigError, check_override_keys, load_config_file, override_keys  # noqa: E402
from agentgym_jax.models import decoder  # noqa: E402
from agentgym_jax.models.config import ModelConfig  # noqa: E402
from agentgym_jax.parallel import partition  # noqa: E402
from agentgym_jax.parallel.mesh import make_mesh  # noqa: E402
from agentgym_jax.rollout.batch import TokenBatch, bucket  # noqa: E402
from agentgym_jax.sampling import buckets  # noqa: E402
from agentgym_jax.sampling.config import SamplingConfig  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler, Turn  # noqa: E402
from agentgym_jax.job import setup  # noqa: E402
from agentgym_jax.train import settings  # noqa: E402
from agentgym_jax.train.state import TrainState, make_optimizer, reference_params  # noqa: E402
from agentgym_jax.train.steps import make_step_fns, train_state_shardings  # noqa: E402
from configs import models  # noqa: E402

GIB = 2**30
# Per-device memory as the device reports it to JAX (nvidia-smi's 81559 MiB and 143771 MiB; a
# v5p chip's 95 GiB): the capacity, before the runtime's own reservations.
HBM_GIB = {"h100_80g": 79.6, "h200_141g": 140.4, "v5p_95g": 95.0}
HEADROOM = 0.10  # a device fits when the peak leaves at least this share of its HBM free



class Flags(NamedTuple):
    config: Any
    num_devices: Any
    chunk: Any
    seq: Any
    run: Any


def define_flags() -> Flags:
    """The command line's flags (defined by `cli`, so importing this file defines none)."""
    return Flags(
        config=config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True),
        num_devices=flags.DEFINE_integer("num_devices", 8, "Devices of the mesh (simulated on the CPU unless --run)."),
        chunk=flags.DEFINE_integer("chunk", 512, "Tokens per episode that the compiled append writes."),
        seq=flags.DEFINE_integer("seq", 0, "Training sequence length; 0: the bucket of rollout.max_cache_len."),
        run=flags.DEFINE_bool("run", False, "Also allocate random weights and run each step once (an accelerator)."),
    )


class Step(NamedTuple):
    """One jitted step: its compiled executable, its arguments (shapes) and what stays live beside it."""

    name: str
    compiled: Any  # jax.stages.Compiled
    args: tuple  # jax.ShapeDtypeStruct pytrees, with shardings
    resident: Any  # pytree of ShapeDtypeStructs live on the devices during the step
    compile_s: float
    temp_from: Any = None  # the compiled step whose temp stands for this one's (see `float32_cache_twins`)


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The job's model (`setup.model_config`): a preset's shape and vocabulary need no checkpoint;
    without one, `tokenizer.vocab_size` stands for the tokenizer the job would build."""
    return setup.model_config(config, config.tokenizer.vocab_size)


def shape_name(config: ml_collections.ConfigDict, model: ModelConfig) -> str:
    """The checkpoint folder's name, the preset's (with `-L<layers>-d<hidden>` if overridden), or L/d."""
    if config.model.hf_dir:
        return pathlib.Path(config.model.hf_dir).name
    preset = config.model.get("preset")
    own = f"L{model.num_layers}-d{model.hidden_size}"
    if not preset:
        return own
    fields = models.PRESETS[preset]["model"]
    plain = lambda v: v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v  # noqa: E731 (a preset's hf_config)
    same = all(plain(config.model[key]) == value for key, value in fields.items())
    return preset if same else f"{preset}-{own}"


def device_bytes(tree: Any) -> int:
    """Bytes per device of a pytree of sharded arrays or ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "dtype"):  # static Python arguments (a chunk size, a flag) take no device memory
            continue
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def with_shardings(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def compile_step(name: str, fn: Any, args: tuple, resident: Any) -> Step:
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return Step(name, compiled, args, resident, time.perf_counter() - start)


def compile_steps(
    config: ml_collections.ConfigDict, model: ModelConfig, mesh: jax.sharding.Mesh, seq: int, chunk: int,
    cpu_proxy: bool = False,
):
    """The four steps of an RL step at the config's shape, compiled for `mesh` (see the docstring);
    with `cpu_proxy` (compiling on the CPU for an accelerator) the sampler's steps carry the temp
    of their float32-cache twins (`float32_cache_twins`)."""
    updates = settings.update(config, model, objective="rl")
    param_dtype = jnp.dtype(config.model.param_dtype)
    tx = make_optimizer(settings.optim(config, config.train.steps))

    def init_state(rng: jax.Array) -> TrainState:
        params = decoder.init_params(model, rng, param_dtype=param_dtype, value_head=updates.rl.uses_critic)
        return TrainState.create(params, tx, jax.random.PRNGKey(1))

    shapes = jax.eval_shape(init_state, jax.random.PRNGKey(0))
    state_shardings = train_state_shardings(shapes, mesh)
    state = with_shardings(shapes, state_shardings)
    # The RL job's frozen reference: a copy of the initial params in the compute dtype, laid out like them.
    reference = functools.partial(reference_params, compute_dtype=updates.forward.compute_dtype)
    ref_params = with_shardings(jax.eval_shape(reference, state.params), state_shardings.params)
    step_fns = make_step_fns(updates, mesh, state_shardings)

    rows = step_fns.padded_rows(config.rollout.batch_tasks * config.rollout.group_size)
    row_sharding = partition.batch_sharding(mesh)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding)  # noqa: E731
    batch = TokenBatch(
        tokens=sds((rows, seq), jnp.int32), positions=sds((rows, seq), jnp.int32),
        loss_mask=sds((rows, seq), jnp.float32), old_logprobs=sds((rows, seq), jnp.float32),
        token_rewards=sds((rows, seq), jnp.float32), group_ids=sds((rows,), jnp.int32), scores=sds((rows,), jnp.float32),
    )
    rl_batch = jax.tree.map(lambda x: sds(x.shape, x.dtype), jax.eval_shape(step_fns.prepare, state.params, ref_params, batch)[0])

    r = config.rollout
    sampling = SamplingConfig(max_new_tokens=r.max_tokens_per_turn, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    make_sampler = functools.partial(Sampler.sharded_decoder, model, sampling, mesh, max_cache_len=r.max_cache_len,
                                     dtype=config.model.compute_dtype, fill_tokens=r.fill_tokens)
    sampler = make_sampler()
    weights = with_shardings(jax.eval_shape(sampler.sampling_params, state.params), sampler.shardings.params)
    opt = (state.opt_state, state.step, state.rng, state.skipped_updates)
    copied = any(w.dtype != p.dtype for w, p in zip(jax.tree.leaves(weights), jax.tree.leaves(state.params)))
    beside_sampler = (state if copied else opt, ref_params)  # without a copy the sampler reads the state's params
    engine_steps = slot_steps if r.num_slots else turn_steps
    sampling_steps = engine_steps(config, model, sampler, weights, rows, chunk, beside_sampler)
    cache_dtype = jnp.dtype(config.model.compute_dtype)
    if cpu_proxy and jnp.issubdtype(cache_dtype, jnp.floating) and cache_dtype.itemsize < 4:
        twins = engine_steps(config, model, make_sampler(cache_dtype=jnp.float32), weights, rows, chunk, beside_sampler)
        sampling_steps = float32_cache_twins(sampling_steps, twins)
    return sampler, [
        *sampling_steps,
        compile_step("prepare", step_fns.prepare, (state.params, ref_params, batch), opt),
        compile_step("rl_update", step_fns.rl_update, (state, rl_batch), ref_params),
    ], init_state, state_shardings


def float32_cache_twins(steps: list[Step], twins: list[Step]) -> list[Step]:
    """`steps` (a 16-bit KV cache) with the temp of `twins`, the same steps over a float32 cache.

    XLA's CPU backend has no bfloat16 scatter: its `float-normalization-bf16` pass converts the
    whole stacked cache to float32 around every per-row cache write and back, copies worth twice
    the cache per write that a GPU or TPU does not make (their float support lists scatter as
    data movement: it writes bfloat16 in place). Over a float32 cache the same steps compile with
    no conversion, and their temporaries bound the 16-bit steps' (the same arrays, with the
    cache's per-layer reads converted to the compute dtype on top); the table prints both.
    """
    return [step._replace(temp_from=twin.compiled) for step, twin in zip(steps, twins, strict=True)]


def sampler_arrays(sampler: Sampler, model: ModelConfig, batch: int, max_len: int):
    """Shapes of the sampler's `batch`-row state: a full-length KV cache and the next-token logits."""
    row_sharding = sampler.shardings.batch
    cache = with_shardings(jax.eval_shape(functools.partial(sampler._init_cache, batch, max_len)), sampler.shardings.cache)
    return cache, jax.ShapeDtypeStruct((batch, model.vocab_size), jnp.float32, sharding=row_sharding)


def turn_spec(sampler: Sampler, batch: int) -> Turn:
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sampler.shardings.batch)  # noqa: E731
    counts = sds((batch,), jnp.int32)
    return Turn(active=sds((batch,), bool), count=counts, limit=counts, forced=counts, seeds=sds((batch, 2), jnp.int32), stop=counts)


def fill_step(config, sampler, weights, cache, logits, chunk, resident) -> Step:
    """A fill of a `chunk`-token chunk into as many rows as the sampler fills at once
    (`Sampler.fill_rows`), over the full cache."""
    batch = logits.shape[0]
    rep = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sampler.shardings.replicated)  # noqa: E731
    k = min(batch, sampler.fill_rows(chunk))
    fill = (weights, cache, logits, rep((k,), jnp.int32), rep((k,), bool), rep((k, chunk), jnp.int32), rep((k,), jnp.int32))
    return compile_step("fill", sampler._fill, (config.rollout.max_cache_len, *fill), resident)


def turn_steps(config, model, sampler, weights, rows, chunk, resident) -> list[Step]:
    """The turn-batched engine's steps (`rollout.num_slots=0`): every episode is a sampler row;
    an append of a `chunk`-token chunk per row into the full cache (one piece of it where every
    row's chunk would pass `rollout.fill_tokens`: `Sampler.append_width` tokens a row, as
    `Sampler.append` goes), then a turn's decode."""
    r = config.rollout
    cache, logits = sampler_arrays(sampler, model, rows, r.max_cache_len)
    width = min(chunk, sampler.append_width(rows))
    tokens = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=sampler.shardings.batch)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sampler.shardings.batch)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sampler.shardings.replicated)
    return [
        compile_step("append", sampler._append, (weights, cache, logits, tokens, lengths), resident),
        compile_step("decode", sampler._decode, (r.max_tokens_per_turn, False, weights, cache, logits,
                                                 turn_spec(sampler, rows), rng), resident),
    ]


def slot_steps(config, model, sampler, weights, rows, chunk, resident) -> list[Step]:
    """The continuous-batching engine's steps (`rollout.num_slots` rows, whatever the episodes):
    a fill of a `chunk`-token chunk into every row at once (observations arriving together) over
    the full cache, then a chunk of `decode_chunk` steps of every row over the full cache: the
    most either takes. (Copying a group's prefilled prompt moves fewer rows than a fill.)"""
    del rows  # the episodes only decide how long the rollout takes, not what a step holds
    r = config.rollout
    batch = buckets.bucket(r.num_slots, sampler.batch_buckets, "number of slots")
    cache, logits = sampler_arrays(sampler, model, batch, r.max_cache_len)
    rep = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sampler.shardings.replicated)  # noqa: E731
    rng = rep((2,), jnp.uint32)
    every_row = rep((batch,), jnp.int32)  # every slot's turn in progress: the largest gather
    decode = (r.decode_chunk, False, r.max_cache_len, weights, cache, logits, turn_spec(sampler, batch), rng, every_row)
    return [
        fill_step(config, sampler, weights, cache, logits, chunk, resident),
        compile_step("decode_rows", sampler._decode_rows, decode, resident),
    ]


def peak_gib(step: Step) -> dict[str, float]:
    """The step's per-device memory (GiB) by kind, and their sum."""
    m = step.compiled.memory_analysis()
    parts = {
        "args": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": -m.alias_size_in_bytes,  # donated inputs reused as outputs are counted once
        "temp": (step.temp_from or step.compiled).memory_analysis().temp_size_in_bytes,
        "resident": device_bytes(step.resident),
    }
    gib = {k: v / GIB for k, v in parts.items()}
    gib["peak"] = sum(gib.values())
    gib["cpu_temp"] = m.temp_size_in_bytes / GIB  # as compiled, with the CPU's float32 conversions
    return gib


def print_table(steps: list[Step]) -> float:
    """The per-step table; returns the largest peak (GiB per device)."""
    cols = ["args", "outputs", "aliased", "temp", "resident", "peak", "cpu_temp"]
    hbm = [f"{name} ({gib:.0f} GiB)" for name, gib in HBM_GIB.items()]
    print("| step | " + " | ".join(f"{c} GiB" for c in cols) + " | compile s | " + " | ".join(hbm) + " |")
    print("| --- |" + " ---: |" * (len(cols) + 1 + len(hbm)))
    largest = 0.0
    for step in steps:
        gib = peak_gib(step)
        largest = max(largest, gib["peak"])
        fits = [f"{gib['peak'] / cap:.0%} {'ok' if gib['peak'] <= (1 - HEADROOM) * cap else 'over'}" for cap in HBM_GIB.values()]
        print(f"| {step.name} | " + " | ".join(f"{gib[c]:.2f}" for c in cols) + f" | {step.compile_s:.1f} | " + " | ".join(fits) + " |")
    return largest


def random_batch(batch: TokenBatch, vocab_size: int, group_size: int) -> TokenBatch:
    """Full-length rows: a prompt of a quarter of the tokens, then policy tokens; 0/1 outcomes."""
    rows, seq = batch.tokens.shape
    rng = np.random.default_rng(0)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 4 :] = 1
    scores = rng.integers(0, 2, rows).astype(np.float32)
    rewards = np.zeros((rows, seq), np.float32)
    rewards[:, -1] = scores
    host = TokenBatch(
        tokens=rng.integers(0, vocab_size, (rows, seq)).astype(np.int32),
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
        loss_mask=mask, old_logprobs=np.zeros((rows, seq), np.float32), token_rewards=rewards,
        group_ids=(np.arange(rows) // group_size).astype(np.int32), scores=scores,
    )
    return jax.device_put(host, jax.tree.map(lambda x: x.sharding, batch))


def peak_memory_gib(devices: list[jax.Device]) -> str:
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return "n/a"
    return f"{max(s['peak_bytes_in_use'] for s in stats) / GIB:.2f}"


def run_steps(config, model, mesh, sampler, steps, init_state, state_shardings) -> None:
    """Random weights at the shape, then each compiled step once: time and peak device memory."""
    devices = list(mesh.devices.flat)
    by_name = {s.name: s for s in steps}
    timed = []

    def timed_call(name, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(by_name[name].compiled(*args))
        timed.append((name, time.perf_counter() - start, peak_memory_gib(devices)))
        return out

    state = jax.jit(init_state, out_shardings=state_shardings)(jax.random.PRNGKey(0))
    compute = settings.forward_pass(config, model).compute_dtype
    ref_params = jax.jit(functools.partial(reference_params, compute_dtype=compute), out_shardings=state_shardings.params)(state.params)
    print(f"\nallocated: train state + reference, peak so far {peak_memory_gib(devices)} GiB per device")
    write, decode = steps[:2]  # the sampler's (append or fill, decode), or with slots (fill, decode_rows)
    weights = sampler.sampling_params(state.params)
    *_, tokens, lengths = write.args
    k, chunk = tokens.shape  # the rows one write computes
    rows = next(a for a in decode.args if isinstance(a, Turn)).count.shape[0]  # the cache's
    rng = np.random.default_rng(1)
    put = lambda x, like: jax.device_put(x, like.sharding)  # noqa: E731
    cache = sampler._init_cache(rows, config.rollout.max_cache_len)
    logits = jax.device_put(np.zeros((rows, model.vocab_size), np.float32), sampler.shardings.batch)
    chunks = (rng.integers(0, model.vocab_size, (k, chunk)).astype(np.int32), np.full(k, chunk, np.int32))
    if write.name == "fill":  # the first rows, each starting empty
        chunks = (np.arange(k, dtype=np.int32), np.ones(k, bool), *chunks)
    cache, logits = timed_call(write.name, weights, cache, logits, *map(put, chunks, write.args[-len(chunks):]))
    turn = Turn.start(np.ones(rows, bool), np.full(rows, config.rollout.max_tokens_per_turn, np.int32))
    turn = Turn(*map(put, turn, next(a for a in decode.args if isinstance(a, Turn))))
    every_row = (put(np.arange(rows, dtype=np.int32), decode.args[-1]),) if decode.name == "decode_rows" else ()
    timed_call(decode.name, weights, cache, logits, turn, jax.random.PRNGKey(2), *every_row)  # static arguments compiled in
    del weights, cache, logits  # the rollout is over: the sampler's copy and cache go
    batch = random_batch(by_name["prepare"].args[2], model.vocab_size, config.rollout.group_size)
    rl_batch, _ = timed_call("prepare", state.params, ref_params, batch)
    timed_call("rl_update", state, rl_batch)
    print(f"\nmeasured on {len(devices)} x {devices[0].device_kind}:")
    print("| step | seconds (one call) | peak memory so far GiB per device |\n| --- | ---: | ---: |")
    for name, seconds, peak in timed:
        print(f"| {name} | {seconds:.3f} | {peak} |")


def main(opts: Flags, argv: list[str]) -> None:
    del argv
    config = opts.config.value
    model = model_config(config)
    devices = jax.devices() if opts.run.value else jax.devices("cpu")
    if len(devices) < opts.num_devices.value:
        raise ConfigError(f"--num_devices={opts.num_devices.value} but only {len(devices)} {devices[0].platform} devices exist")
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices[: opts.num_devices.value])
    seq = opts.seq.value or bucket(config.rollout.max_cache_len, 64)  # as the RL loop pads its batch
    name = pathlib.Path(_flag(sys.argv, "config", "?").split(":")[0]).stem
    shape = shape_name(config, model)
    print(
        f"config={name} model={shape} (layers {model.num_layers}, hidden {model.hidden_size}, heads "
        f"{model.num_heads}/{model.num_kv_heads}, vocab {model.vocab_size}) mesh={dict(mesh.shape)} "
        f"params={config.model.param_dtype} compute={config.model.compute_dtype} remat={config.model.remat} "
        f"rows={config.rollout.batch_tasks * config.rollout.group_size} seq={seq} "
        f"cache={config.rollout.max_cache_len} chunk={opts.chunk.value} on {devices[0].platform}\n"
    )
    cpu_proxy = devices[0].platform == "cpu"
    sampler, steps, init_state, state_shardings = compile_steps(config, model, mesh, seq, opts.chunk.value, cpu_proxy)
    largest = print_table(steps)
    if opts.run.value:
        run_steps(config, model, mesh, sampler, steps, init_state, state_shardings)
    fits = int(largest <= (1 - HEADROOM) * HBM_GIB["h100_80g"])
    print(f"summary: config={name} model={shape} seq={seq} max_device_gib={largest:.2f} fits_h100_80g={fits}")


def cli() -> None:
    spec = _flag(sys.argv, "config", "")
    try:
        if not spec:
            raise ConfigError("missing --config=configs/<name>.py")
        check_override_keys(load_config_file(spec), override_keys(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    app.run(functools.partial(main, define_flags()))


if __name__ == "__main__":
    cli()
