"""`mode=rl`: SFT warm start on oracle demonstrations, evaluation, RL with a horizon schedule,
evaluation again, and a before/after report. Read it top to bottom; it is the whole job.

Resume is exact: a killed run restarted with the same command restores the train state (params,
optimizer, RNG, skipped-update count), the frozen reference and the loop position from the last
checkpoint. What each RL step does is a pure function of its index: the tasks (a seeded
permutation of the training split), the horizon (`rl/horizon.py`) and the sampling key
(`fold_in(seed, step)`), so the resumed steps are the steps the uninterrupted run would take.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from agentgym_jax.parallel.distributed import initialize_distributed
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.rl.horizon import from_config as horizon_schedule
from agentgym_jax.rollout.batch import bucket, make_token_batch
from agentgym_jax.rollout.demonstrations import demonstration_trajectory
from agentgym_jax.rollout.trajectory import write_jsonl
from agentgym_jax.train import build
from agentgym_jax.train.checkpoint import Checkpointer
from agentgym_jax.train.jobs import episode_texts, evaluate, optim_config, play_oracle, rollout_metrics, task_batch
from agentgym_jax.train.metrics import MetricsLogger, read_metrics
from agentgym_jax.train.sft import sft_train
from agentgym_jax.train.state import TrainState, make_optimizer, reference_params
from agentgym_jax.train.steps import make_step_fns, train_state_shardings


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    start_time = time.time()
    initialize_distributed()
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    schedule = horizon_schedule(config.horizon)
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(build.environment_urls(config.env))  # before JAX starts threads
        mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
        ckpt = Checkpointer(str(workdir / "checkpoints"), config.train.checkpoint_every, config.train.keep_checkpoints)
        stack.callback(ckpt.close)
        info = build.fetch_task_info(config.env, urls)
        resuming = ckpt.latest_step is not None
        episodes = [] if resuming or config.sft.num_tasks == 0 else play_oracle(config, urls, info)
        framing = build.tokenizer_and_framing(config, workdir, episode_texts(info, episodes))
        model = build.model_config(config, len(framing.tokenizer))
        (workdir / "config.json").write_text(json.dumps(model.to_hf_dict(), indent=2))  # for mode=eval
        update_config = build.update_config(config, model)
        rng = jax.random.PRNGKey(config.seed)
        params = build.initial_params(config, model, mesh, rng, value_head=update_config.uses_critic)
        state = TrainState.create(params, make_optimizer(optim_config(config.optim, config.train.steps)), jax.random.PRNGKey(config.seed + 2))
        state_shardings = train_state_shardings(state, mesh)
        state = jax.device_put(state, state_shardings)  # also the layout a restore reads into
        step_fns = make_step_fns(update_config, mesh, state_shardings)
        test_ids = sorted(info.splits["test"])[: config.eval.num_tasks]
        eval_engine = stack.enter_context(build.make_engine(
            config, model, framing, urls, info, build.rollout_config(config, temperature=config.eval.temperature, group_size=1)
        ))
        train_engine = stack.enter_context(build.make_engine(config, model, framing, urls, info, build.rollout_config(config)))

        if resuming:
            (state, ref_params), meta = ckpt.restore((state, reference_params(params, update_config.compute_dtype)))
            logging.info("resumed from step %d", meta["rl_step"])
        else:
            meta = {"rl_step": 0, "cursor": 0, "stage": schedule.stage(0)}
            if episodes:  # SFT warm start on the successful oracle demonstrations
                demos = [demonstration_trajectory(framing, info, ep, group_id=i) for i, ep in enumerate(episodes)]
                write_jsonl(str(workdir / "demonstrations.jsonl"), demos, append=False)
                sft_tx = make_optimizer(optim_config(config.optim, config.train.steps, lr=config.sft.lr))
                sft_state = TrainState.create(state.params, sft_tx, jax.random.PRNGKey(config.seed + 3))
                sft_state, history = sft_train(
                    sft_state, [d for d in demos if d.success], update_config,
                    batch_size=config.sft.batch_size, epochs=config.sft.epochs, seed=config.seed, mesh=mesh,
                )
                state = state.replace(params=sft_state.params, opt_state=state.tx.init(sft_state.params))
                meta["sft_final_nll"] = history[-1]["nll"]
            ref_params = reference_params(state.params, update_config.compute_dtype)
            meta["eval_before"] = evaluate(eval_engine, state.params, test_ids, config.eval.horizon, config.seed)
            ckpt.save(0, (state, ref_params), meta, force=True)

        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=meta["rl_step"])
        for step in range(meta["rl_step"], config.train.steps):
            horizon = schedule.horizon(step)
            tasks = task_batch(info.splits["train"], step, config.rollout.batch_tasks, config.seed)
            t0 = time.time()
            trajectories = train_engine.run(
                state.params, tasks, horizon, jax.random.fold_in(jax.random.PRNGKey(config.seed), step),
                policy_version=step, group_offset=0,
            )
            rollout_s = time.time() - t0
            write_jsonl(str(workdir / "trajectories.jsonl"), trajectories)
            batch = make_token_batch(
                trajectories, seq_len=bucket(max(len(t.token_ids) for t in trajectories), 64),
                batch_size=step_fns.padded_rows(len(trajectories)),  # empty rows, so rows divide over the mesh
            )
            t1 = time.time()
            rl_batch, prep_metrics = step_fns.prepare(state.params, ref_params, batch)
            state, update_metrics = step_fns.rl_update(state, rl_batch)
            update_metrics = jax.device_get(update_metrics)
            update_s = time.time() - t1
            metrics = {
                **rollout_metrics(trajectories), **jax.device_get(prep_metrics), **update_metrics,
                "horizon": horizon, "stage": schedule.stage(step), "rollout_s": rollout_s, "update_s": update_s,
                "tokens_per_s": float(np.sum(np.asarray(batch.positions) >= 0)) / max(rollout_s + update_s, 1e-9),
                "sampler_wait_fraction": train_engine.last_stats.wait_fraction,
            }
            logger.log(step + 1, metrics)
            meta = {**meta, "rl_step": step + 1, "cursor": (step + 1) * config.rollout.batch_tasks,
                    "stage": schedule.stage(step + 1)}
            ckpt.save(step + 1, (state, ref_params), meta, force=step + 1 == config.train.steps)
        logger.close()

        after = evaluate(eval_engine, state.params, test_ids, config.eval.horizon, config.seed)
    return _report(config, workdir, info, test_ids, meta["eval_before"], after, start_time)


def _report(config, workdir, info, test_ids, before, after, start_time) -> dict[str, float]:
    """Prints the before/after table and the summary line; saves report.json and the curve."""
    rows = ["success_rate", "mean_reward", "turns", "invalid_action_rate"]
    print(f"\n| metric ({len(test_ids)} held-out {info.env} tasks) | after SFT | after RL |")
    print("| --- | --- | --- |")
    for key in rows:
        print(f"| {key} | {before[key]:.3f} | {after[key]:.3f} |")
    _plot_learning_curve(workdir)
    minutes = (time.time() - start_time) / 60
    summary = {"success_before": before["success_rate"], "success_after": after["success_rate"], "minutes": minutes}
    (workdir / "report.json").write_text(json.dumps({"before": before, "after": after, **summary}, indent=2))
    print(
        f"summary: env={info.env} heldout_tasks={len(test_ids)} success_before={before['success_rate']:.3f} "
        f"success_after={after['success_rate']:.3f} minutes={minutes:.1f}"
    )
    return summary


def _plot_learning_curve(workdir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(str(workdir / "metrics.jsonl"))
    if not records:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["success_rate"] for r in records], label="train success")
    ax.plot([r["step"] for r in records], [r["horizon"] / max(r["horizon"] for r in records) for r in records],
            "--", label="horizon (scaled)")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(workdir / "learning_curve.png", dpi=100)
    plt.close(fig)
