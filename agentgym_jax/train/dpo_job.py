"""`mode=dpo`: Direct Preference Optimization on pairs of collected trajectories.

Pairs (`train/dpo_pairs.py`): a success and a failure of the same task, from the trajectory JSONL
files in `data.trajectories` (e.g. `mode=collect` with a sampling policy). The policy starts from
`init` (a job folder with `config.json`, `tokenizer/` and `checkpoints/`, e.g. a `mode=sft` run;
empty: `model.hf_dir`) and the reference is a frozen copy of it. Per batch, the reference
log-probs are computed once (`reference_logprobs`, jitted, no gradient), then `dpo_update` takes
one optimizer step on the loss of `rl/dpo.py`: -log sigmoid(beta * (sum of policy-token
log-ratios of the chosen - of the rejected)). Batches are consecutive slices of per-epoch seeded
permutations of the pairs (`jobs.task_batch`), all padded to one shape; checkpoints are
`(TrainState, reference params)` like the RL job's, so a killed run resumes exactly and
`mode=eval` reads them. With several processes, every one reads the pairs and places its own
rows of every global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax.config import ConfigError
from agentgym_jax.job import setup
from agentgym_jax.models.config import load_config
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.parallel.distributed import barrier, is_writer, rows_from_host
from agentgym_jax.parallel.mesh import BATCH_AXES
from agentgym_jax.parallel.partition import batch_sharding
from agentgym_jax.rl.dpo import dpo_loss
from agentgym_jax.rollout.batch import TokenBatch, bucket
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.train.dpo_pairs import build_pairs, pair_batches
from agentgym_jax.job import settings as job_settings
from agentgym_jax.train import settings
from agentgym_jax.train.jobs import check_token_ids, task_batch
from agentgym_jax.train.metrics import MetricsLogger
from agentgym_jax.train.state import TrainState, make_optimizer, reference_params
from agentgym_jax.train.steps import UpdateConfig, token_logprobs, train_state_shardings


@flax.struct.dataclass
class DPOBatch:
    chosen: TokenBatch  # [pairs, seq]
    rejected: TokenBatch  # [pairs, seq], the same shape (`dpo_pairs.pair_batches`)
    chosen_ref_logprobs: jax.Array  # [pairs, seq] frozen reference
    rejected_ref_logprobs: jax.Array  # [pairs, seq]


def pair_logprobs(params: Any, chosen: TokenBatch, rejected: TokenBatch, config: UpdateConfig) -> tuple[jax.Array, jax.Array]:
    """Log-probs of every token of the chosen and rejected rows, each [pairs, seq].

    One forward over the rows of both (`[2 * pairs, seq]`): half the program of two forwards, so
    the update compiles in about half the time.
    """
    tokens = jnp.concatenate([chosen.tokens, rejected.tokens])  # [2 * pairs, seq]
    positions = jnp.concatenate([chosen.positions, rejected.positions])
    logprobs = token_logprobs(params, tokens, positions, config.forward)[0]
    return logprobs[: chosen.tokens.shape[0]], logprobs[chosen.tokens.shape[0] :]


def reference_logprobs(ref_params: Any, chosen: TokenBatch, rejected: TokenBatch, config: UpdateConfig) -> tuple[jax.Array, jax.Array]:
    """Frozen-reference log-probs of the chosen and rejected rows, each [pairs, seq] (no gradient)."""
    return jax.lax.stop_gradient(pair_logprobs(ref_params, chosen, rejected, config))


def dpo_objective(params: Any, batch: DPOBatch, config: UpdateConfig, beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of `rl/dpo.py` under `params`, and its metrics."""
    chosen_logprobs, rejected_logprobs = pair_logprobs(params, batch.chosen, batch.rejected, config)
    loss, metrics = dpo_loss(
        chosen_logprobs, batch.chosen_ref_logprobs, batch.chosen.loss_mask,
        rejected_logprobs, batch.rejected_ref_logprobs, batch.rejected.loss_mask, beta=beta,
    )
    return loss, {**metrics, "loss": loss}


def dpo_update(state: TrainState, batch: DPOBatch, config: UpdateConfig, beta: float) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on the DPO loss (skipped and counted if not finite)."""
    (_, metrics), grads = jax.value_and_grad(dpo_objective, has_aux=True)(state.params, batch, config, beta)
    metrics["grad_norm"] = optax.global_norm(grads)
    return state.apply_gradients(grads, loss=metrics["loss"]), metrics


@dataclasses.dataclass(frozen=True)
class DPOStepFns:
    reference: Callable[[Any, TokenBatch, TokenBatch], tuple[jax.Array, jax.Array]]  # (ref_params, chosen, rejected)
    update: Callable[[TrainState, DPOBatch], tuple[TrainState, dict[str, jax.Array]]]  # donates the state
    objective: Callable[[Any, DPOBatch], tuple[jax.Array, dict[str, jax.Array]]]  # (params, batch), no update


def make_dpo_step_fns(config: UpdateConfig, beta: float, mesh: Mesh | None = None,
                      state_shardings: TrainState | None = None) -> DPOStepFns:
    """The jitted DPO steps; over a mesh with explicit shardings like `steps.make_step_fns`
    (state by `state_shardings`, pair rows over ("data", "fsdp"), metrics replicated)."""
    params = state = rows = replicated = None
    if mesh is not None:
        params, state = state_shardings.params, state_shardings
        rows, replicated = batch_sharding(mesh), NamedSharding(mesh, P())

    def jit(fn: Callable, ins: tuple, outs: Any, **kw) -> Callable:
        shardings = {} if mesh is None else dict(in_shardings=ins, out_shardings=outs)
        return jax.jit(fn, **shardings, **kw)

    return DPOStepFns(
        reference=jit(functools.partial(reference_logprobs, config=config), (params, rows, rows), (rows, rows)),
        update=jit(functools.partial(dpo_update, config=config, beta=beta), (state, rows), (state, replicated),
                   donate_argnums=0),
        objective=jit(functools.partial(dpo_objective, config=config, beta=beta), (params, rows), replicated),
    )


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    paths = [p.strip() for p in config.data.trajectories.split(",") if p.strip()]
    if not paths:
        raise ConfigError("mode=dpo needs data.trajectories (trajectory JSONL files with successes and failures)")
    pairs = build_pairs(t for path in paths for t in read_jsonl(path))
    if not pairs:
        raise ConfigError(f"no preference pairs in {paths}: no task has both a success and a failure")
    with contextlib.ExitStack() as stack:
        job_settings.require_untuned(config)
        job = stack.enter_context(setup.open_job(config, servers=False))
        workdir, mesh = job.workdir, job.mesh
        init = pathlib.Path(config.init) if config.init else None
        tokenizer = load_tokenizer(setup.tokenizer_dir(config, init or workdir))  # copied for mode=eval
        model = load_config(init) if init else setup.model_config(config, len(tokenizer))
        check_token_ids((t for pair in pairs for t in pair), model.vocab_size)
        setup.write_model_config(workdir, model)
        dtype = jnp.dtype(config.model.param_dtype)
        if init:
            params = setup.checkpoint_params(init / "checkpoints", config.init_step, model, mesh, dtype)
        elif config.model.hf_dir:
            params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(config.seed), value_head=False)
        else:
            raise ConfigError("mode=dpo starts from a trained policy: set init=<job folder> or model.hf_dir")
        if is_writer() and not (workdir / "tokenizer").exists():  # mode=eval reads <workdir>/tokenizer
            tokenizer.save_pretrained(str(workdir / "tokenizer"))
        barrier("dpo-tokenizer")
        tx = make_optimizer(settings.optim(config, config.train.steps))
        state = TrainState.create(params, tx, jax.random.PRNGKey(config.seed + 2))
        shardings = train_state_shardings(state, mesh)
        state = jax.device_put(state, shardings)
        updates = settings.update(config, model)
        ref_params = reference_params(state.params, updates.forward.compute_dtype)
        fns = make_dpo_step_fns(updates, config.dpo.beta, mesh, shardings)
        ckpt = setup.checkpointer(config, workdir)
        stack.callback(ckpt.close)
        start = ckpt.latest_step or 0
        if start:
            (state, ref_params), _ = ckpt.restore((state, ref_params))
            logging.info("resumed DPO at step %d", start)

        seq_len = bucket(max(len(t.token_ids) for pair in pairs for t in pair))  # one shape: one compilation
        shards = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
        rows = -(-config.train.batch_size // shards) * shards  # empty rows, so rows divide over the mesh
        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=start, write=is_writer(),
                               desc="dpo")
        metrics: dict[str, float] = {}
        for step in range(start, config.train.steps):
            picked = [pairs[i] for i in task_batch(range(len(pairs)), step, config.train.batch_size, config.seed)]
            chosen, rejected = rows_from_host(pair_batches(picked, seq_len, rows), batch_sharding(mesh))
            ref_chosen, ref_rejected = fns.reference(ref_params, chosen, rejected)
            state, step_metrics = fns.update(state, DPOBatch(chosen, rejected, ref_chosen, ref_rejected))
            metrics = logger.log(step + 1, jax.device_get(step_metrics))
            ckpt.save(step + 1, (state, ref_params), {"step": step + 1, "pairs": len(pairs)},
                      force=step + 1 == config.train.steps)
        logger.close()
    return metrics
