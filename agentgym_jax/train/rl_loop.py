"""`mode=rl`: SFT warm start on oracle demonstrations, evaluation, RL with a horizon schedule,
evaluation again, and a before/after report. Read it top to bottom; it is the whole job.

Resume is exact: a killed run restarted with the same command restores the train state (params,
optimizer, RNG, skipped-update count), the frozen reference and the loop position from the last
checkpoint, and cuts metrics.jsonl, TensorBoard and the trajectory files back to that step
(the later steps are replayed). What each RL step does is a pure function of its index: the
tasks (a seeded permutation of the training split, or of the part a difficulty curriculum
admits: `rl/curriculum.py`), the horizon (`rl/horizon.py`) and the sampling key
(`fold_in(seed, step)`), so the resumed steps are the steps the uninterrupted run would take.
The report's `minutes` are the run's, over every process that ran it (`train/rl_report.py`);
re-running a finished job prints its report again and changes nothing.

Several processes (`job/setup.py`): each plays its share of the step's tasks on its own servers
and devices, and the update runs on the global batch of every process's episodes.
"""

from __future__ import annotations

import contextlib
import pathlib
import time

import jax
import ml_collections
from absl import logging

from agentgym_jax.job import setup
from agentgym_jax.parallel.distributed import (
    broadcast_object, gather_objects, initialize_distributed, is_writer, process_share,
)
from agentgym_jax.rollout.demonstrations import demonstration_trajectory
from agentgym_jax.rollout.trajectory import truncate_jsonl, write_jsonl
from agentgym_jax.job import settings as job_settings
from agentgym_jax.train.jobs import critic_states, episode_texts, evaluate, play_oracle, rollout_metrics, task_batch
from agentgym_jax.train import rl_report, settings
from agentgym_jax.train.metrics import MetricsLogger
from agentgym_jax.train.sft import sft_num_updates, sft_train
from agentgym_jax.train.state import TrainState, make_optimizer, reference_params
from agentgym_jax.train.steps import make_step_fns, train_state_shardings


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    start_time = time.time()
    process_minutes = lambda: (time.time() - start_time) / 60  # noqa: E731  (this process's)
    schedule = settings.horizon_schedule(config.horizon)
    curriculum = settings.curriculum(config.curriculum)
    finished = _finished(config)
    if finished is not None:  # nothing left to do: the report as it was, nothing rewritten
        return finished
    with contextlib.ExitStack() as stack:
        job = stack.enter_context(setup.open_job(config))
        workdir, mesh, info = job.workdir, job.mesh, job.info
        settings.check_curriculum(curriculum, info.splits["train"], info.metadata)
        ckpt = setup.checkpointer(config, workdir)
        stack.callback(ckpt.close)
        resuming = ckpt.latest_step is not None
        episodes = [] if resuming or config.sft.num_tasks == 0 else play_oracle(config, job.urls, info)
        framing = setup.tokenizer_and_framing(config, workdir, episode_texts(info, episodes))
        model = setup.model_config(config, len(framing.tokenizer))
        setup.write_model_config(workdir, model)
        updates = settings.update(config, model, with_rl=True)
        rng = jax.random.PRNGKey(config.seed)
        params = setup.initial_params(config, model, mesh, rng, value_head=updates.rl.shared_value_head)
        params, frozen = setup.split_params(config, params, mesh, jax.random.PRNGKey(config.seed + 6))  # LoRA, top layers
        rl_tx = make_optimizer(settings.rl_optim(config, updates.batching.updates_per_step))  # schedule in optimizer updates
        state = TrainState.create(params, rl_tx, jax.random.PRNGKey(config.seed + 2), frozen=frozen)
        state_shardings = train_state_shardings(state, mesh)
        state = jax.device_put(state, state_shardings)  # also the layout a restore reads into
        critic = critic_states(config, updates, mesh, params)  # [] or [PPO's separate critic]
        step_fns = make_step_fns(updates, mesh, state_shardings, *(train_state_shardings(c, mesh) for c in critic))
        test_ids = sorted(info.splits["test"])[: config.eval.num_tasks]
        eval_engine = stack.enter_context(setup.make_engine(
            config, model, framing, job.urls, info, job_settings.rollout(config, temperature=config.eval.temperature, group_size=1)
        ))
        train_engine = stack.enter_context(setup.make_engine(config, model, framing, job.urls, info, job_settings.rollout(config)))
        def sampler_params(state: TrainState):  # the merged policy on this process's devices
            return setup.sampler_params(config, job, setup.policy_params(config, mesh, state.params, state.frozen))

        if resuming:
            (state, ref_params, *critic), meta = ckpt.restore(
                (state, reference_params(params, updates.forward.compute_dtype), *critic))
            logging.info("resumed from step %d", meta["rl_step"])
        else:
            meta = {"rl_step": 0, "cursor": 0, "stage": schedule.stage(0)}
            if config.sft.num_tasks:  # SFT warm start on the successful oracle demonstrations
                _, first = process_share(range(config.sft.num_tasks), "sft.num_tasks", even=False)
                demos = setup.gather_trajectories([demonstration_trajectory(framing, info, ep, group_id=first + i)
                                             for i, ep in enumerate(episodes)])
                if is_writer():
                    write_jsonl(str(workdir / "demonstrations.jsonl"), demos, append=False)
                successes = [d for d in demos if d.success]
                sft_updates = sft_num_updates(len(successes), config.sft.batch_size, config.sft.epochs)
                sft_tx = make_optimizer(settings.optim(config, sft_updates, lr=config.sft.lr))
                sft_state = TrainState.create(state.params, sft_tx, jax.random.PRNGKey(config.seed + 3), frozen=state.frozen)
                sft_state, history = sft_train(
                    sft_state, successes, updates,
                    batch_size=config.sft.batch_size, epochs=config.sft.epochs, seed=config.seed, mesh=mesh,
                    length_window=config.sft.length_window, progress=is_writer(),
                )
                fresh_opt = jax.jit(state.tx.init, out_shardings=state_shardings.opt_state)  # placed like the state
                state = state.replace(params=sft_state.params, frozen=sft_state.frozen,  # both donated through SFT
                                      opt_state=fresh_opt(sft_state.params))
                meta["sft_final_nll"] = history[-1]["nll"]
            ref_params = reference_params(state.params, updates.forward.compute_dtype)
            if not config.algo.critic_dir:  # a critic copied from the policy starts from the warm-started one
                critic = critic_states(config, updates, mesh, state.params, *(c.tx for c in critic))
            meta["eval_before"] = evaluate(eval_engine, sampler_params(state), test_ids, config.eval.horizon,
                                           config.seed, desc="eval before RL")
            ckpt.save(0, (state, ref_params, *critic), {**meta, "minutes": process_minutes()}, force=True)
        resumed_from = meta["rl_step"] if resuming else None
        earlier_minutes = meta.get("minutes", 0.0) if resuming else 0.0  # the earlier processes' time to the checkpoint
        run_minutes = lambda: earlier_minutes + process_minutes()  # noqa: E731

        trajectories_path = str(setup.process_file(workdir, "trajectories.jsonl"))
        truncate_jsonl(trajectories_path, before_version=meta["rl_step"])  # the steps after it are replayed
        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=meta["rl_step"], write=is_writer(),
                               desc="rl")
        for step in range(meta["rl_step"], config.train.steps):
            horizon = schedule.horizon(step)
            pool = curriculum.pool(info.splits["train"], info.metadata, step)
            tasks, first = process_share(task_batch(pool, step, config.rollout.batch_tasks, config.seed), "rollout.batch_tasks")
            t0 = time.time()
            trajectories = train_engine.run(
                sampler_params(state), tasks, horizon, jax.random.fold_in(jax.random.PRNGKey(config.seed), step),
                policy_version=step, group_offset=first,
            )
            rollout_s = time.time() - t0
            write_jsonl(trajectories_path, trajectories)
            batch, batch_metrics = setup.global_token_batch(  # unscored episodes masked, dynamic sampling, overlong;
                trajectories, step_fns.padded_rows, mesh, settings.batch_filter(config))  # empty rows: rows divide over the mesh
            t1 = time.time()
            rl_batch, prep_metrics = step_fns.prepare(state.policy_params, state.policy_of(ref_params), batch,
                                                     *(c.params for c in critic))
            state, update_metrics = step_fns.rl_update(state, rl_batch)
            if critic:
                critic[0], critic_metrics = step_fns.critic_update(critic[0], rl_batch)
                update_metrics = {**update_metrics, **critic_metrics}
            update_metrics = jax.device_get(update_metrics)
            update_s = time.time() - t1
            tokens = sum(gather_objects(sum(len(t.token_ids) for t in trajectories)))
            metrics = {
                **rollout_metrics(trajectories, all_processes=True), **batch_metrics, **jax.device_get(prep_metrics), **update_metrics,
                "horizon": horizon, "stage": schedule.stage(step), "task_pool": len(pool), "rollout_s": rollout_s, "update_s": update_s,
                "tokens_per_s": tokens / max(rollout_s + update_s, 1e-9),
                "sampler_wait_fraction": train_engine.last_stats.wait_fraction,
            }
            logger.log(step + 1, metrics)
            meta = {**meta, "rl_step": step + 1, "cursor": (step + 1) * config.rollout.batch_tasks,
                    "stage": schedule.stage(step + 1)}
            ckpt.save(step + 1, (state, ref_params, *critic), {**meta, "minutes": run_minutes()},
                      force=step + 1 == config.train.steps)
        logger.close()

        after = evaluate(eval_engine, sampler_params(state), test_ids, config.eval.horizon, config.seed,
                         desc="eval after RL")
        if state.frozen:  # checkpoints hold the adapters (or top layers); the merged policy goes beside them
            setup.export_policy(config, workdir, model, mesh, state.params, state.frozen)
    if not is_writer():
        return {"success_before": meta["eval_before"]["success_rate"], "success_after": after["success_rate"]}
    this_process = process_minutes()
    record = rl_report.build_report(
        env=info.env, seed=config.seed, steps=config.train.steps, reward_shaping=config.env.reward_shaping,
        before=meta["eval_before"], after=after, minutes=earlier_minutes + this_process, process_minutes=this_process,
        resumed_from_step=resumed_from,
    )
    rl_report.write_report(workdir, record)
    return rl_report.print_report(record)


def _finished(config: ml_collections.ConfigDict) -> dict[str, float] | None:
    """The summary of a job that already ran to its end in `config.workdir` (its report printed
    again), else None. Every process follows process 0, which reads the report."""
    initialize_distributed()  # before anything asks JAX how many processes there are
    workdir = pathlib.Path(config.workdir)
    record = broadcast_object(
        rl_report.finished_report(workdir, config.env.name, config.train.steps) if is_writer() else None)
    if record is None:
        return None
    if is_writer():
        print(f"{workdir} holds this job, finished ({record['steps']} steps in {record['minutes']:.1f} minutes); "
              "its report, unchanged:")
        return rl_report.print_report(record)
    return {key: record[key] for key in ("success_before", "success_after", "minutes")}

