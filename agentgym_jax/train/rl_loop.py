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

An agent program as the environment (`env.agent`, docs/agents.md): the episodes of each step are
`group_size` calls of the agent per task against this process's in-process gateway, which serves
the newest weights (`gateway/episodes.py`); its held-out evaluations play the agent too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time

import jax
import ml_collections
from absl import logging

from agentgym_jax.config import ConfigError
from agentgym_jax.gateway import episodes as agent_episodes
from agentgym_jax.gateway.agents import AgentSpec
from agentgym_jax.job import memory_maps, play, setup
from agentgym_jax.job.compile_clock import CompileClock
from agentgym_jax.parallel.distributed import broadcast_object, gather_objects, initialize_distributed, is_writer
from agentgym_jax.rollout.trajectory import truncate_jsonl, write_jsonl
from agentgym_jax.train import build, rl_episodes, rl_report, rl_signal, settings
from agentgym_jax.train.metrics import MetricsLogger
from agentgym_jax.train.sft import BehaviourCloning
from agentgym_jax.train.state import make_optimizer, reference_params


def run(config: ml_collections.ConfigDict) -> dict[str, float]:
    start_time = time.time()
    process_minutes = lambda: (time.time() - start_time) / 60  # noqa: E731  (this process's)
    schedule = settings.horizon_schedule(config.horizon_schedule)
    curriculum = settings.curriculum(config.curriculum)
    signal, rules = settings.signal(config), settings.batch_filter(config)  # pass-rate controls (train/rl_signal.py)
    agent = AgentSpec.of(config.env)  # None, or the agent program that plays each episode
    if agent is not None and config.eval.sampled:
        raise ConfigError("eval.sampled: an agent program's evaluation plays through its own gateway; "
                          "sample it with eval.temperature instead")
    finished = _finished(config)
    if finished is not None:  # nothing left to do: the report as it was, nothing rewritten
        return finished
    with contextlib.ExitStack() as stack:
        # The job: servers, mesh, checkpoints; oracle demonstrations (also the tokenizer's text) unless resuming.
        job = stack.enter_context(setup.open_job(config))
        compiles = stack.enter_context(CompileClock())  # a step's compiling seconds, apart from its work
        workdir, mesh, info = job.workdir, job.mesh, job.info
        settings.check_curriculum(curriculum, info.splits["train"], info.metadata)
        settings.check_signal(config, signal, rules, info.metadata)
        ckpt = setup.checkpointer(config, workdir)
        stack.callback(ckpt.close)
        resuming = ckpt.latest_step is not None
        episodes = [] if resuming or config.sft.num_tasks == 0 else play.oracle_episodes(config, job.pool(), info)
        framing, model = setup.tokenizer_and_model(config, workdir, play.episode_texts(info, episodes))

        # The policy, its update, the separate critic if any, and the engines that sample it.
        update = settings.update(config, model, objective="rl")
        params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(config.seed), value_head=update.rl.shared_value_head)
        critic = build.critic_states(config, update, mesh, params)  # [] or [PPO's separate critic]
        rl_tx = make_optimizer(settings.rl_optim(config, update.batching.updates_per_step))  # schedule in optimizer updates
        state, step_fns = build.policy_state(config, update, params, mesh, rl_tx, *critic)
        settings.check_step_rows(config, update, step_fns.padded_rows)  # before SFT, not at the first update
        rollout = settings.rl_rollout(config, model)
        if agent is None:
            held_out = play.HeldOut.of(config, job, model, framing)
            train_engine = stack.enter_context(setup.make_engine(config, job, model, framing, rollout))
            sampled = play.HeldOut.sampled_of(config, job, framing, train_engine.sampler, rollout)
        else:
            sampled = None
            held_out = play.HeldOut.of(config, job, model, framing, agent_episodes.agent_policy(config, agent, workdir / "held_out"))

        def local_policy(state, own: bool = False):  # the merged policy on this process's sampler devices
            return setup.local_policy(config, job, setup.policy_params(config, mesh, state.params, state.frozen), own)

        # Resume, or warm start: SFT on the successful demonstrations, the frozen reference, evaluation before RL.
        if resuming:
            (state, ref_params, *critic), meta = ckpt.restore(
                (state, reference_params(state.params, update.forward.compute_dtype), *critic))
            logging.info("resumed from step %d", meta["rl_step"])
            if sampled and "sampled_before" not in meta:
                raise ConfigError(f"eval.sampled={config.eval.sampled}, but this run's evaluation before RL had none "
                                  f"(its checkpoint's eval.sampled was 0); resume with eval.sampled=0")
        else:
            meta = {"rl_step": 0, "cursor": 0, "stage": schedule.stage(0)}
            if config.sft.num_tasks:
                demos = play.demonstrations(config, framing, info, episodes)
                if is_writer():
                    write_jsonl(str(workdir / "demonstrations.jsonl"), demos, append=False)
                sft_state, history = BehaviourCloning(config, update, mesh).train(
                    state.params, [d for d in demos if d.success], epochs=config.sft.epochs, seed=config.seed,
                    frozen=state.frozen)
                state = build.restart_optimizer(state, sft_state.params, sft_state.frozen, mesh)
                meta["sft_final_nll"] = history[-1]["nll"]
            ref_params = reference_params(state.params, update.forward.compute_dtype)
            if not config.algo.critic_dir:  # a critic copied from the policy starts from the warm-started one
                critic = build.critic_states(config, update, mesh, state.params, *(c.tx for c in critic))
            meta["eval_before"] = held_out(local_policy(state), workdir / "eval_before.jsonl", "eval before RL")
            if sampled:
                meta["sampled_before"] = sampled(local_policy(state), workdir / "sampled_before.jsonl", "sampled eval before RL")
            ckpt.save(0, (state, ref_params, *critic), {**meta, "minutes": process_minutes()}, force=True)
        resumed_from = meta["rl_step"] if resuming else None
        earlier_minutes = meta.get("minutes", 0.0) if resuming else 0.0  # the earlier processes' time to the checkpoint
        run_minutes = lambda: earlier_minutes + process_minutes()  # noqa: E731

        # RL: each step's tasks, horizon and sampling key are functions of the step (exact resume); or,
        # asynchronous, groups streamed at most rollout.max_staleness updates behind (train/rl_episodes.py).
        trajectories_path = str(setup.process_file(workdir, "trajectories.jsonl"))
        truncate_jsonl(trajectories_path, before_step=meta["rl_step"])  # the steps after it are replayed
        logger = MetricsLogger(str(workdir), total_steps=config.train.steps, start_step=meta["rl_step"], write=is_writer(),
                               desc="rl")
        # algo.shared_prefix: each group's rows packed as one prefix tree (its prompt computed once), whole
        # units (groups) per micro-batch and per batch shard.
        packed = dict(rows_per_unit=config.rollout.group_size * settings.rows_per_episode(config), unit_multiple=math.lcm(
            step_fns.row_shards, update.batching.num_minibatches * update.batching.num_microbatches),
        ) if update.batching.shared_prefix else {}
        plan = rl_episodes.StepPlan(schedule, curriculum, info, config.rollout.batch_tasks, config.seed, config.train.steps)
        positions = meta.get("episodes") or [{}] * jax.process_count()  # each process's stream, where it stood
        stream_settings, position = settings.async_rollout(config, update.rl.corrects_off_policy), positions[jax.process_index()]
        if agent is None:
            # With pass-rate controls (replayed prefixes, pass-rate-targeted tasks, extra groups): train/rl_signal.py.
            source = (rl_signal.Steered(plan, train_engine, signal, rules, position) if signal.steers(rules)
                      else rl_episodes.of(plan, train_engine, stream_settings, position))
            step_rows = step_fns.padded_rows
        else:  # every step through the stream (max_staleness 0: each batch admitted once the update before it landed)
            streams = agent_episodes.agent_streams(config, job, model, framing, agent)
            stack.callback(streams.close)
            source = rl_episodes.Asynchronous(plan, streams, stream_settings, position)
            episode_rows = config.rollout.batch_tasks * config.rollout.group_size * settings.rows_per_episode(config)
            step_rows = lambda rows: step_fns.padded_rows(max(rows, episode_rows))  # noqa: E731  (one shape a step)
        stack.callback(source.close)
        compiles.lap()  # the first step's compiles count from here
        step_start = time.time()
        for step in range(meta["rl_step"], config.train.steps):
            if not isinstance(source, rl_episodes.Asynchronous):  # (its streams sample on other threads)
                memory_maps.release_if_near_limit()
            trajectories, rollout_metrics = source.take(step, lambda: local_policy(state, source.needs_own_weights))
            trajectories = [dataclasses.replace(t, train_step=step) for t in trajectories]
            write_jsonl(trajectories_path, trajectories)
            batch, batch_metrics = setup.global_token_batch(  # unscored episodes masked, dynamic sampling, overlong;
                trajectories, step_rows, mesh, rules, **packed,  # empty rows: rows divide over the mesh
                anchor_states="step_groups" in update.rl.estimator.inputs)
            t1 = time.time()
            rl_batch, prep_metrics = step_fns.prepare(state.policy_params, state.policy_of(ref_params), batch,
                                                     *(c.params for c in critic))
            state, update_metrics = step_fns.rl_update(state, rl_batch)
            if critic:
                critic[0], critic_metrics = step_fns.critic_update(critic[0], rl_batch)
                update_metrics = {**update_metrics, **critic_metrics}
            update_metrics = jax.device_get(update_metrics)
            update_s = time.time() - t1
            source.updated(step + 1, lambda: local_policy(state, source.needs_own_weights))
            step_s, step_start = time.time() - step_start, time.time()
            compile_s, programs = compiles.lap()
            tokens = sum(gather_objects(sum(len(t.token_ids) for t in trajectories)))
            sampler_busy_s, sampler_wait_s = rollout_metrics.pop("sampler_busy_s"), rollout_metrics.pop("sampler_wait_s")
            metrics = {
                **play.rollout_metrics(trajectories, all_processes=True), **batch_metrics, **jax.device_get(prep_metrics),
                **update_metrics, **rollout_metrics, "stage": schedule.stage(step), "update_s": update_s, "step_s": step_s,
                "compile_s": compile_s, "compiled_programs": programs,
                "tokens_per_s": tokens / step_s, "sampler_idle_fraction": max(0.0, 1 - sampler_busy_s / step_s),
                "sampler_wait_fraction": sampler_wait_s / step_s, "trainer_idle_fraction": rollout_metrics["rollout_s"] / step_s,
            }
            logger.log(step + 1, metrics)
            meta = {**meta, "episodes": gather_objects(source.position()), "rl_step": step + 1, "cursor": (step + 1) * config.rollout.batch_tasks,
                    "stage": schedule.stage(step + 1)}
            ckpt.save(step + 1, (state, ref_params, *critic), {**meta, "minutes": run_minutes()},
                      force=step + 1 == config.train.steps)
        source.close()
        if agent is not None:
            streams.close()  # the training gateway's rows go before the evaluation's gateway takes its own
        logger.close()

        # Evaluation after RL; a tuned policy's merged export beside its checkpoints (which hold what trained).
        memory_maps.release_if_near_limit()
        after = held_out(local_policy(state), workdir / "eval_after.jsonl", "eval after RL")
        sampled_after = sampled(local_policy(state), workdir / "sampled_after.jsonl", "sampled eval after RL") if sampled else None
        if state.frozen:
            setup.export_policy(config, workdir, model, mesh, state.params, state.frozen)

    # The report: before and after, minutes over every process that ran the job.
    if not is_writer():
        return {"success_before": meta["eval_before"]["success_rate"], "success_after": after["success_rate"]}
    this_process = process_minutes()
    record = rl_report.build_report(
        env=info.env, seed=config.seed, steps=config.train.steps, reward_shaping=config.env.reward_shaping,
        before=meta["eval_before"], after=after, minutes=earlier_minutes + this_process, process_minutes=this_process,
        resumed_from_step=resumed_from, curriculum=source.summary() if isinstance(source, rl_signal.Steered) else None,
        grading=rl_report.task_grades(info.metadata, signal.replay_by or curriculum.key),
        sampled=dict(temperature=config.rollout.temperature, samples=config.eval.sampled,
                     before=meta["sampled_before"], after=sampled_after) if sampled else None,
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

