"""`mode=dpo`: Direct Preference Optimization on pairs of collected trajectories.

Pairs (`train/dpo_pairs.py`): a success and a failure of the same task, from the trajectory JSONL
files in `data.trajectories` (e.g. `mode=collect` with a sampling policy). The policy starts from
`init` (a job folder with `config.json`, `tokenizer/` and `checkpoints/`, e.g. a `mode=sft` run;
empty: `model.hf_dir`) and the reference is a frozen copy of it. Per batch, the reference
log-probs are computed once (`steps.dpo_reference`, no gradient), then `steps.dpo_update` takes
one optimizer step on the loss of `rl/dpo.py`: -log sigmoid(beta * (sum of policy-token
log-ratios of the chosen - of the rejected)), on the update path every mode shares: accumulated
over `algo.num_microbatches` micro-batches (each pass over the batch, the reference's too, one
micro-batch at a time: architecture rule 10). Batches are consecutive slices of per-epoch seeded
permutations of the pairs (`play.task_batch`), all padded to one shape; checkpoints are
`(TrainState, reference params)` like the RL job's, so a killed run resumes exactly and
`mode=eval` reads them. With several processes, every one reads the pairs and places its own
rows of every global batch.
"""

from __future__ import annotations

import contextlib
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from agentgym_jax.config import ConfigError
from agentgym_jax.job import play, setup
from agentgym_jax.job import settings as job_settings
from agentgym_jax.models.config import load_config
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.parallel.distributed import barrier, is_writer, rows_from_host
from agentgym_jax.parallel.partition import batch_sharding
from agentgym_jax.rollout.batch import bucket
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.train import build, settings
from agentgym_jax.train.dpo_pairs import build_pairs, pair_batches, pair_layout, pair_width
from agentgym_jax.train.metrics import MetricsLogger
from agentgym_jax.train.state import make_optimizer, reference_params
from agentgym_jax.train.steps import DPOBatch


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    # The pairs, before any work.
    paths = [p.strip() for p in config.data.trajectories.split(",") if p.strip()]
    if not paths:
        raise ConfigError("mode=dpo needs data.trajectories (trajectory JSONL files with successes and failures)")
    pairs = build_pairs(t for path in paths for t in read_jsonl(path))
    if not pairs:
        raise ConfigError(f"no preference pairs in {paths}: no task has both a success and a failure")
    job_settings.require_untuned(config)
    with contextlib.ExitStack() as stack:
        # The job (no servers), the starting policy's tokenizer and model, its params.
        job = stack.enter_context(setup.open_job(config, servers=False))
        workdir, mesh = job.workdir, job.mesh
        init = pathlib.Path(config.init) if config.init else None
        tokenizer = load_tokenizer(setup.tokenizer_dir(config, init or workdir))  # copied for mode=eval
        model = load_config(init) if init else setup.model_config(config, len(tokenizer))
        setup.check_token_ids((t for pair in pairs for t in pair), model.vocab_size)
        setup.write_model_config(workdir, model)
        if init:
            params = setup.checkpoint_params(init / "checkpoints", config.init_step, model, mesh, jnp.dtype(config.model.param_dtype))
        elif config.model.hf_dir:
            params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(config.seed), value_head=False)
        else:
            raise ConfigError("mode=dpo starts from a trained policy: set init=<job folder> or model.hf_dir")
        if is_writer() and not (workdir / "tokenizer").exists():  # mode=eval reads <workdir>/tokenizer
            tokenizer.save_pretrained(str(workdir / "tokenizer"))
        barrier("dpo-tokenizer")

        # The policy's train state and DPO update, the frozen reference (a copy of the start); resume.
        update = settings.update(config, model, objective="dpo")
        state, step_fns = build.policy_state(config, update, params, mesh, make_optimizer(settings.optim(config, config.train.steps)))
        ref_params = reference_params(state.params, update.forward.compute_dtype)
        ckpt = setup.checkpointer(config, workdir)
        stack.callback(ckpt.close)
        start = ckpt.latest_step or 0
        if start:
            (state, ref_params), _ = ckpt.restore((state, ref_params))
            logging.info("resumed DPO at step %d", start)

        # The steps: a batch of pairs, one shape for all (one compilation), empty rows to divide over the mesh.
        seq_len = bucket(max(len(t.token_ids) for pair in pairs for t in pair))
        width = pair_width(pairs) if update.batching.shared_prefix else None  # a pair's two rows as one prefix tree
        rows = step_fns.padded_rows(config.train.batch_size)
        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=start, write=is_writer(),
                               desc="dpo")
        metrics: dict[str, float] = {}
        for step in range(start, config.train.steps):
            picked = [pairs[i] for i in play.task_batch(range(len(pairs)), step, config.train.batch_size, config.seed)]
            chosen, rejected = pair_batches(picked, seq_len, rows)
            layout = None if width is None else pair_layout(chosen, rejected, width)
            chosen, rejected, layout = rows_from_host((chosen, rejected, layout), batch_sharding(mesh))
            ref_chosen, ref_rejected = step_fns.dpo_reference(ref_params, chosen, rejected, layout)
            state, step_metrics = step_fns.dpo_update(state, DPOBatch(chosen, rejected, ref_chosen, ref_rejected, layout))
            metrics = logger.log(step + 1, jax.device_get(step_metrics))
            ckpt.save(step + 1, (state, ref_params), {"step": step + 1, "pairs": len(pairs)},
                      force=step + 1 == config.train.steps)
        logger.close()
    return metrics
