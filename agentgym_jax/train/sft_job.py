"""`mode=sft`: supervised fine-tuning on a weighted mix of environments.

Data: trajectory JSONL files (`data.trajectories`, e.g. from `mode=collect`; failed episodes are
dropped unless `data.include_failures`) and AgentGym conversation files (`data.agentgym`,
AgentTraj-L style, imported with the loss on trained `gpt` turns only). Every row is tagged with
its environment: the trajectory's `env`, the AgentGym item's `<env>_<id>`.

The rows of every batch are fixed before training by the mixture rule (`train/sft_data.py`), so a
resumed run takes exactly the batches of an uninterrupted one.

Checkpoints (`checkpoints/<step>`, `(TrainState, {})`, loadable by `mode=eval` with
`policy=checkpoint:<workdir>`), metrics (`metrics.jsonl`, TensorBoard; `rows/<env>` counts the
rows of each environment in the step's batch), resume, and an optional greedy evaluation on
`eval.num_tasks` held-out tasks of `env.name` at the end. With several processes, every one reads
the data and builds the same schedule; each places its own rows of every global batch, and the
evaluation splits its tasks over them.
"""

from __future__ import annotations

import collections
import contextlib
import json

import jax
import ml_collections
from absl import logging

from agentgym_jax.job import play, setup
from agentgym_jax.parallel.distributed import is_writer, rows_from_host
from agentgym_jax.parallel.partition import batch_sharding
from agentgym_jax.rollout.batch import bucket, make_token_batch
from agentgym_jax.train import build, settings
from agentgym_jax.train.metrics import MetricsLogger
from agentgym_jax.train.sft_data import conversation_texts, load_rows, mixture_schedule, parse_weights
from agentgym_jax.train.state import make_optimizer


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    with contextlib.ExitStack() as stack:
        # The job (servers only for a final evaluation), the tokenizer and model, the data and its schedule.
        job = stack.enter_context(setup.open_job(config, servers=bool(config.eval.num_tasks)))
        workdir, mesh = job.workdir, job.mesh
        framing, model = setup.tokenizer_and_model(config, workdir, conversation_texts(config))
        rows = load_rows(config, framing)
        setup.check_token_ids((t for r in rows.values() for t in r), model.vocab_size)
        weights = parse_weights(config.data.weights) or {e: float(len(r)) for e, r in rows.items()}
        schedule = mixture_schedule({e: len(r) for e, r in rows.items()}, weights, config.train.batch_size,
                                    config.train.steps, config.seed)

        # The policy (LoRA or top layers where `config.model` says) and its update; resume.
        params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(config.seed), value_head=False)
        tx = make_optimizer(settings.optim(config, config.train.steps))
        state, step_fns = build.policy_state(config, settings.update(config, model), params, mesh, tx)
        ckpt = setup.checkpointer(config, workdir)
        stack.callback(ckpt.close)
        start = ckpt.latest_step or 0
        if start:
            (state, _), _ = ckpt.restore((state, {}))
            logging.info("resumed SFT at step %d", start)

        # The steps: each batch the schedule's rows, padded to its own length bucket.
        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=start, write=is_writer(),
                               desc="sft")
        for step in range(start, config.train.steps):
            picked = [rows[e][i] for e, i in schedule[step]]
            seq_len = bucket(max(len(t.token_ids) for t in picked))  # the batch's own bucket: one compilation per bucket
            batch = make_token_batch(picked, seq_len, step_fns.padded_rows(config.train.batch_size))
            state, metrics = step_fns.sft_update(state, rows_from_host(batch, batch_sharding(mesh)))
            counts = collections.Counter(e for e, _ in schedule[step])
            logger.log(step + 1, {**jax.device_get(metrics), **{f"rows/{e}": counts[e] for e in rows}})
            ckpt.save(step + 1, (state, {}), {"step": step + 1}, force=step + 1 == config.train.steps)
        logger.close()
        if state.frozen:  # checkpoints hold the adapters (or top layers); the merged policy goes beside them
            setup.export_policy(config, workdir, model, mesh, state.params, state.frozen)

        # An evaluation on held-out tasks of `env.name`, where asked.
        result = {}
        if config.eval.num_tasks:
            held_out = play.HeldOut.of(config, job, model, framing)
            policy = setup.local_policy(config, job, setup.policy_params(config, mesh, state.params, state.frozen))
            result = held_out(policy, workdir / "eval.jsonl", "eval")
            if is_writer():
                (workdir / "eval.json").write_text(json.dumps(result, indent=2))
                print(f"summary: env={job.info.env} heldout_tasks={len(held_out.task_ids)} success={result['success_rate']:.3f}")
    return result
