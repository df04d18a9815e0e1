"""`mode=agentevol`: AgentEvol (AgentGym, arXiv 2406.04151, section 4) as the paper describes it.

Iteration 0 is behaviour cloning on the base demonstrations (oracle episodes of `sft.num_tasks`
training tasks). Each iteration i >= 1 explores: the policy of iteration i - 1 plays
`agentevol.group_size` episodes of every exploration task (`agentevol.explore_tasks`
training tasks, a superset of the demonstration tasks) at `agentevol.temperature`; the episodes
the environment's verifier calls a success are kept, merged with the base
demonstrations and deduplicated by (task, token sequence); the policy is trained on that set,
from the base model (`agentevol.from_base`, the paper's choice) or continuing from iteration
i - 1, for `agentevol.epochs` epochs (0: `sft.epochs`); then evaluated greedily on held-out test
tasks. Each iteration's optimizer starts fresh, its schedule spanning that iteration's updates.
(AgentGym's released code explores greedily, one sample per task; the paper samples.)

Files: `iter_<i>/explored.jsonl` (every explored episode), `iter_<i>/data.jsonl` (the training
set of iteration i), `iter_<i>/eval.json`,
`checkpoints/<i>` (the orbax train state of iteration i; `mode=eval` loads it with
`policy=checkpoint:<workdir> checkpoint_step=<i>`), `progress.json` (per-iteration summary).
An iteration is complete when its checkpoint exists (orbax renames a finished save into place,
and the checkpoint is written last); a killed run restarted with the same command continues
with the first incomplete iteration, from the last complete one's parameters. What iteration i
does is a function of (seed, i) and the previous parameters: exploration key `fold_in(seed, i)`,
SFT shuffling seed `seed + i`. With several processes, each explores its share of the tasks and
every process trains on the gathered episodes (process 0 writes the files).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterable, Sequence

import jax
import ml_collections
from absl import logging

from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.job import play, setup
from agentgym_jax.job import settings as job_settings
from agentgym_jax.parallel.distributed import is_writer, process_share
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.collect import show_rollout
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl, write_jsonl
from agentgym_jax.train import settings
from agentgym_jax.train.sft import BehaviourCloning


def keep_successes(trajectories: Iterable[Trajectory]) -> list[Trajectory]:
    """Explored episodes the environment's verifier called a success (not a reward threshold:
    shaped partial credit may pay a failure as much as the threshold)."""
    return [t for t in trajectories if t.success]


def merge_dedup(base: Sequence[Trajectory], explored: Sequence[Trajectory]) -> list[Trajectory]:
    """`base` then `explored`, keeping the first of each (env, task, token sequence)."""
    seen: set[tuple[str, int, tuple[int, ...]]] = set()
    out = []
    for t in (*base, *explored):
        key = (t.env, t.task_id, tuple(t.token_ids))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def run(config: ml_collections.ConfigDict) -> dict[str, dict[str, float]]:
    evol = config.agentevol
    if evol.iterations < 0 or evol.group_size < 1 or evol.epochs < 0:
        raise ValueError(f"agentevol.iterations ({evol.iterations}) and epochs ({evol.epochs}) must be >= 0 and "
                         f"group_size ({evol.group_size}) >= 1")
    job_settings.require_untuned(config)
    with contextlib.ExitStack() as stack:
        # The job: servers, mesh, checkpoints (one per iteration); the base demonstrations, played once.
        job = stack.enter_context(setup.open_job(config))
        workdir, mesh, info = job.workdir, job.mesh, job.info
        demos_path = workdir / "demonstrations.jsonl"
        ckpt = setup.checkpointer(config, workdir, every=1, keep=evol.iterations + 1)
        stack.callback(ckpt.close)
        have_demos = demos_path.exists()
        episodes = [] if have_demos else play.oracle_episodes(config, job.pool(), info)
        framing, model = setup.tokenizer_and_model(config, workdir, play.episode_texts(info, episodes))
        if have_demos:
            demos = list(read_jsonl(str(demos_path)))
        else:  # every process's share, gathered: the same base set on every process
            demos = [d for d in play.demonstrations(config, framing, info, episodes) if d.success]
            if is_writer():
                write_jsonl(str(demos_path), demos, append=False)

        # The base policy, its behaviour cloning, the exploration tasks and engine, the evaluation.
        base_params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(config.seed), value_head=False)
        cloning = BehaviourCloning(config, settings.update(config, model), mesh)
        state, _ = cloning.fresh_state(base_params, rows=len(demos), epochs=config.sft.epochs)  # the layout a restore reads
        explore_ids = play.task_batch(info.splits["train"], 0, evol.explore_tasks or len(info.splits["train"]), config.seed + 1)
        explore_share, explore_first = process_share(explore_ids, "agentevol.explore_tasks", even=False)
        explore_engine = stack.enter_context(setup.make_engine(
            config, job, model, framing, job_settings.rollout(config, temperature=evol.temperature, group_size=evol.group_size)))
        held_out = play.HeldOut.of(config, job, model, framing)
        local_policy = lambda p: setup.local_policy(config, job, p)  # noqa: E731  (this process's devices)

        # Resume after the last complete iteration; then explore, keep the successes, clone, evaluate.
        start = 0 if ckpt.latest_step is None else ckpt.latest_step + 1
        if start:
            (state, _), _ = ckpt.restore((state, {}), step=start - 1)
            logging.info("resuming AgentEvol at iteration %d", start)
        for it in range(start, evol.iterations + 1):
            it_dir = workdir / f"iter_{it}"
            explored = trajectories = []
            if it:
                with Progress(f"explore iteration {it}", len(explore_share) * evol.group_size, "episode") as bar:
                    mine = explore_engine.run(
                        local_policy(state.params), explore_share, evol.horizon,
                        jax.random.fold_in(jax.random.PRNGKey(config.seed), it), policy_version=it - 1,
                        group_offset=explore_first, on_progress=show_rollout(bar),
                    ) if explore_share else []
                trajectories = setup.gather_trajectories(mine)
                if is_writer():
                    write_jsonl(str(it_dir / "explored.jsonl"), trajectories, append=False)
                explored = keep_successes(trajectories)
            data = merge_dedup(demos, explored)
            if is_writer():
                write_jsonl(str(it_dir / "data.jsonl"), data, append=False)
            init = base_params if evol.from_base or it == 0 else state.params
            init = jax.tree.map(lambda x: x.copy(), init)  # the update donates its state
            epochs = config.sft.epochs if it == 0 else evol.epochs or config.sft.epochs
            state, history = cloning.train(init, data, epochs=epochs, seed=config.seed + it)
            result = held_out(local_policy(state.params), it_dir / "eval.jsonl", f"eval iteration {it}")
            record = {
                "iteration": it, "explored_episodes": len(trajectories), "kept": len(explored),
                "train_trajectories": len(data), "sft_final_nll": history[-1]["nll"], "eval": result,
            }
            if is_writer():
                (it_dir / "eval.json").write_text(json.dumps(record, indent=2))
            ckpt.save(it, (state, {}), {"iteration": it}, force=True)  # completes the iteration
            if is_writer():
                _write_progress(workdir, it, info, held_out.task_ids)
                print(f"agentevol: iteration={it} train_trajectories={len(data)} "
                      f"heldout_success={result['success_rate']:.3f}", flush=True)
    # every iteration's held-out metrics, from the eval.json files (process 0's; others see them on a shared disk)
    return {it: json.loads(path.read_text())["eval"] for it in range(evol.iterations + 1)
            if (path := workdir / f"iter_{it}" / "eval.json").exists()}


def _write_progress(workdir: pathlib.Path, last: int, info: TaskInfo, test_ids: Sequence[int]) -> None:
    """`progress.json`: the records of iterations 0..`last` (from their eval.json files)."""
    records = {str(i): json.loads((workdir / f"iter_{i}" / "eval.json").read_text()) for i in range(last + 1)}
    body = {"env": info.env, "heldout_tasks": len(test_ids), "completed": last, "iterations": records}
    tmp = workdir / "progress.json.tmp"
    tmp.write_text(json.dumps(body, indent=2))
    tmp.replace(workdir / "progress.json")
