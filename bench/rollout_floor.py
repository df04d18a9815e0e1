"""Where one RL step's rollout of a recipe spends its CPU seconds, against this machine's floor.

    taskset -c 0 python bench/rollout_floor.py                     # configs/textcraft_smollm.py, step 0
    taskset -c 0 python bench/rollout_floor.py --step=3 --decode_chunk=8
    taskset -c 0 python bench/rollout_floor.py --num_slots=24     # the slot engine instead
    taskset -c 0 python bench/rollout_floor.py --horizon=3        # a shorter run: 3 turns per episode
    taskset -c 0 python bench/rollout_floor.py --params_from=runs/tc/checkpoints   # a run's SFT'd policy

The rollout: the recipe's tasks and horizon of RL step `--step` (`rl_episodes.StepPlan`), its
sampler and engine as `job/setup.py` builds them, the pretrained policy (or `--params_from`, a
run's checkpoint folder, step 0: the policy after SFT), played twice with the same key: cold
(compiling) and warm (the same shapes: nothing to compile, the same trajectories). Times are
process CPU seconds (every thread of this process; pin it with `taskset` so neighbours' load
does not count), and each sampler call's go to one part: prompt prefill (prefill, or a slot
fill of prompts and its copies), observation appends, decode (generate or decode chunks); the
rest of the process is the host (event loop, HTTP client, tokenizer, trajectories). The
environment server's own CPU seconds are read from /proc. Compilations: their count and wall
seconds, per part, in the cold run.

The floor: the same episodes computed with nothing above the work itself, timed in this run.
- Decode: every episode's sampled tokens, one decode step for all episodes with tokens left
  (batch = live episodes), each token attending over its own context only. A step costs
  `a + sum over its rows of (m + s * context)`: a, m, s fitted to the sampler's own decode
  timed at (episodes rows, long cache), (episodes, short cache) and (a quarter of them, long):
  the fixed cost of a step (reading the weights), a row's matmuls, a row's attention per slot.
- Prefill: each distinct prompt once and every appended token once, no padding: `m' + s' *
  context` per token, fitted to two appends timed here (fresh prompts; observations onto long
  caches).
Last line: `summary: rollout_cpu_s=<warm> floor_cpu_s=<floor> floor_fraction=<floor / warm>
cold_rollout_cpu_s=<cold>`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.job import setup  # noqa: E402
from agentgym_jax.job import settings as job_settings  # noqa: E402
from agentgym_jax.rollout.trajectory import Trajectory  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler, Turn  # noqa: E402
from agentgym_jax.train import rl_episodes  # noqa: E402
from agentgym_jax.train import settings  # noqa: E402
from configs import smollm  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001  (progress lines through pipes)

# The sampler's public calls and the part of the rollout each one is; calls inside another
# (generate's decode chunks, prefill's copies) count for the outer one.
PARTS = {
    "prefill": "prompt prefill", "copy_prefix": "prompt prefill", "row_logits": "prompt prefill",
    "append": "observation appends", "generate": "decode", "decode_chunk": "decode", "init_slots": "other sampler",
}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class PartClock:
    """Process CPU seconds, calls and compilations per part of the sampler's work."""

    def __init__(self, sampler: Sampler):
        self.cpu: collections.Counter = collections.Counter()
        self.compile_s: collections.Counter = collections.Counter()
        self.compiles: collections.Counter = collections.Counter()
        self.current: str | None = None
        jax.monitoring.register_event_duration_secs_listener(self._compiled)
        for name, part in PARTS.items():
            setattr(sampler, name, self._timed(getattr(sampler, name), part))
        sampler.fill = self._timed(sampler.fill, None)  # prompts or observations: its `fresh` says

    def _compiled(self, event: str, seconds: float, **kw) -> None:
        if event == COMPILE_EVENT:
            self.compile_s[self.current or "outside the sampler"] += seconds
            self.compiles[self.current or "outside the sampler"] += 1

    def _timed(self, call, part: str | None):
        def timed(*args, **kwargs):
            if self.current is not None:  # inside another sampler call: counted there
                return call(*args, **kwargs)
            name = part or fill_part(*args, **kwargs)
            self.current, start = name, time.process_time()
            try:
                return jax.block_until_ready(call(*args, **kwargs))
            finally:
                self.cpu[name] += time.process_time() - start
                self.current = None
        return timed

    def reset(self) -> None:
        for counter in (self.cpu, self.compile_s, self.compiles):
            counter.clear()


def fill_part(params, state, rows, chunks, fresh, index) -> str:
    """The part a slot fill is: prompts (its rows start fresh) or observations."""
    return "prompt prefill" if all(fresh) else "observation appends"


def children_cpu_s() -> float:
    """CPU seconds of this process's child processes (the environment servers), from /proc."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in pathlib.Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@dataclasses.dataclass
class Work:
    """What the episodes needed: the floor's inputs, from their trajectories."""

    prompts: list[int]  # lengths of the distinct prompts
    appended: list[tuple[int, int]]  # (context before, tokens) of every appended run after a prompt
    sampled: list[np.ndarray]  # per episode, the context length of each sampled token

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> Work:
        prompts, appended, sampled = {}, [], []
        for t in trajectories:
            if not t.turn_spans:
                continue
            start = t.turn_spans[0][0]
            prompts[tuple(t.token_ids[:start])] = start
            mask = np.asarray(t.loss_mask[: t.turn_spans[-1][1]], bool)
            sampled.append(np.flatnonzero(mask))
            runs = np.flatnonzero(np.diff(np.concatenate([[1], mask.astype(np.int8)])) == -1)  # starts of 0-runs
            for run in runs[runs >= start]:
                end = run + np.argmax(mask[run:]) if mask[run:].any() else len(mask)
                appended.append((int(run), int(end - run)))
        return cls(list(prompts.values()), appended, sampled)


def filled_cache(sampler: Sampler, rows: int, slots: int, filled: int):
    """A cache of `rows` x `slots` whose first `filled` slots of every row hold tokens, and zero logits."""
    positions = np.where(np.arange(slots) < filled, np.arange(slots), -1).astype(np.int32)
    cache = sampler._init_cache(rows, slots).replace(
        positions=jnp.asarray(np.tile(positions, (rows, 1))), index=jnp.full((rows,), filled, jnp.int32))
    return cache, jnp.zeros((rows, sampler._vocab_size), jnp.float32)


def time_decode(sampler: Sampler, params, rows: int, slots: int, steps: int = 8) -> float:
    """CPU seconds of one decode step of `rows` rows, each attending over `slots` filled slots
    (the sampler's own decode loop, every row forced to `steps` tokens; best of 2 after a compile)."""
    turn = Turn.start(np.ones(rows, bool), np.full(rows, steps, np.int32), np.full(rows, steps, np.int32))
    best = []
    for _ in range(3):
        cache, logits = filled_cache(sampler, rows, slots, slots - steps)
        start = time.process_time()
        jax.block_until_ready(sampler._decode(steps, True, params, cache, logits, turn, jax.random.key(0)))
        best.append((time.process_time() - start) / steps)
    return min(best[1:])


def time_append(sampler: Sampler, params, rows: int, width: int, before: int) -> float:
    """CPU seconds of appending `width` real tokens to each of `rows` rows that hold `before`
    tokens (the sampler's own append; best of 2 after a compile)."""
    tokens = np.random.default_rng(0).integers(0, 1000, (rows, width)).astype(np.int32)
    lengths = np.full((rows,), width, np.int32)
    best = []
    for _ in range(3):
        cache, logits = filled_cache(sampler, rows, before + width, before)
        start = time.process_time()
        jax.block_until_ready(sampler._append(params, cache, logits, tokens, lengths))
        best.append(time.process_time() - start)
    return min(best[1:])


def floor(sampler: Sampler, params, work: Work, episodes: int, long_slots: int) -> dict[str, float]:
    """The floor's seconds per part, and the fitted costs (see the module docstring)."""
    quarter = max(episodes // 4, 1)
    print(f"timing the floor's costs: decode at ({episodes}, {long_slots}), ({episodes}, 128), ({quarter}, {long_slots}) "
          f"rows x slots; appends ({len(work.prompts)} x 128 fresh), ({episodes} x 32 onto {long_slots - 32})")
    t_long = time_decode(sampler, params, episodes, long_slots)
    t_short = time_decode(sampler, params, episodes, 128)
    t_few = time_decode(sampler, params, quarter, long_slots)
    s = (t_long - t_short) / (episodes * (long_slots - 128))
    m = (t_long - t_few) / (episodes - quarter) - long_slots * s
    a = t_long - episodes * (m + long_slots * s)
    p_fresh = time_append(sampler, params, len(work.prompts), 128, 0)
    p_long = time_append(sampler, params, episodes, 32, long_slots - 32)
    # per token: m2 + s2 * context; the fresh chunk's tokens attend over 64 slots on average
    n_fresh, n_long = len(work.prompts) * 128, episodes * 32
    s2 = (p_long / n_long - p_fresh / n_fresh) / (long_slots - 32 + 16 - 64)
    m2 = p_fresh / n_fresh - 64 * s2
    contexts = np.concatenate(work.sampled)
    steps = max(len(c) for c in work.sampled)
    decode = a * steps + m * len(contexts) + s * contexts.sum()
    prompt = sum(n * m2 + s2 * n * (n - 1) / 2 for n in work.prompts)
    appended = sum(n * m2 + s2 * (n * before + n * (n - 1) / 2) for before, n in work.appended)
    print(f"decode step: {1e3 * a:.1f} ms + per row {1e3 * m:.2f} ms + per row and slot {1e6 * s:.2f} us "
          f"(timed: {1e3 * t_long:.0f} / {1e3 * t_short:.0f} / {1e3 * t_few:.0f} ms)")
    print(f"prefill token: {1e3 * m2:.2f} ms + per slot of context {1e6 * s2:.2f} us "
          f"({n_fresh / p_fresh:.0f} tokens/s fresh, {n_long / p_long:.0f} tokens/s onto {long_slots - 32} slots)")
    return {"prompt prefill": prompt, "observation appends": appended, "decode": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="textcraft", choices=list(smollm.RECIPES), help="configs/smollm.py's recipe")
    parser.add_argument("--step", type=int, default=0, help="the RL step whose tasks and horizon are played")
    parser.add_argument("--num_slots", type=int, default=None, help="rollout.num_slots (default: the recipe's)")
    parser.add_argument("--decode_chunk", type=int, default=None, help="rollout.decode_chunk (default: the recipe's)")
    parser.add_argument("--horizon", type=int, default=None, help="turns per episode (default: the step's; fewer: a shorter run)")
    parser.add_argument("--params_from", default="", help="a run's checkpoint folder: its step-0 policy (after SFT)")
    args = parser.parse_args()

    config = smollm.get_config(args.recipe)
    config.workdir = tempfile.mkdtemp(prefix="bench_rollout_floor_")
    for key in ("num_slots", "decode_chunk"):
        if getattr(args, key) is not None:
            config.rollout[key] = getattr(args, key)
    with setup.open_job(config) as job:
        framing, model = setup.tokenizer_and_model(config, job.workdir, [])
        if args.params_from:
            params = setup.checkpoint_params(pathlib.Path(args.params_from), 0, model, job.mesh, jnp.float32)
        else:
            params = setup.initial_params(config, model, job.mesh, jax.random.PRNGKey(config.seed), value_head=False)
        plan = rl_episodes.StepPlan(settings.horizon_schedule(config.horizon_schedule), settings.curriculum(config.curriculum),
                                    job.info, config.rollout.batch_tasks, config.seed, config.train.steps)
        tasks, _, _ = plan.tasks(args.step)
        horizon = args.horizon or plan.schedule.horizon(args.step)
        rollout = job_settings.rollout(config)
        with setup.make_engine(config, job, model, framing, rollout) as engine:
            policy = setup.local_policy(config, job, params, False)
            clock = PartClock(engine.sampler)
            print(f"{jax.devices()[0].platform}, {os.cpu_count()} cores visible, pinned to {sorted(os.sched_getaffinity(0))}, "
                  f"load average {os.getloadavg()[0]:.1f}: {args.recipe} step {args.step}: tasks {tasks} x "
                  f"{rollout.group_size}, horizon {horizon}, <= {rollout.max_tokens_per_turn} tokens/turn, "
                  f"num_slots={rollout.num_slots}, decode_chunk={rollout.decode_chunk}, temperature {rollout.temperature}")
            runs = {}
            for name in ("cold", "warm"):
                clock.reset()
                cpu, server = time.process_time(), children_cpu_s()
                trajectories = engine.run(policy, tasks, horizon, jax.random.PRNGKey(args.step), policy_version=0)
                runs[name] = dict(cpu=time.process_time() - cpu, server=children_cpu_s() - server, parts=dict(clock.cpu),
                                  compile_s=dict(clock.compile_s), compiles=dict(clock.compiles), stats=engine.last_stats,
                                  trajectories=trajectories)
                print(f"[{name}] {runs[name]['cpu']:.1f} CPU s ({engine.last_stats.wall_s:.1f} s wall), "
                      f"{sum(clock.compiles.values())} compilations ({sum(clock.compile_s.values()):.1f} s wall)")
            same = sum(a.token_ids == b.token_ids for a, b in zip(runs["cold"]["trajectories"], trajectories))
            work = Work.of(trajectories)
            long_slots = engine.sampler._cache_bucket(max(len(t.token_ids) for t in trajectories))
            floors = floor(engine.sampler, engine.sampler.sampling_params(policy), work, len(trajectories), long_slots)

    cold, warm, stats = runs["cold"], runs["warm"], runs["warm"]["stats"]
    sampled = sum(len(c) for c in work.sampled)
    real_appended = sum(n for _, n in work.appended)
    computed = {
        "prompt prefill": f"{stats.prompt_tokens_computed} tokens / {sum(work.prompts)} distinct",
        # (not counted by trees before `observation_tokens_computed`: a baseline's run)
        "observation appends": f"{getattr(stats, 'observation_tokens_computed', '?')} tokens / {real_appended}",
        "decode": f"{stats.decode_row_steps} row-steps / {sampled} tokens",
    }
    host = warm["cpu"] - sum(warm["parts"].values())
    print(f"\n{len(trajectories)} episodes, {stats.turns} turns, statuses "
          f"{dict(collections.Counter(t.status.value for t in trajectories))}; trajectories of the two runs identical: "
          f"{same} of {len(trajectories)}; sampler waited {stats.sampler_wait_s:.1f} s on the environment (wall)\n")
    print("| part | cold CPU s | compilations (wall s) | warm CPU s | computed / needed | floor CPU s | floor / warm |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for part in ("prompt prefill", "observation appends", "decode", "other sampler"):
        if part not in cold["parts"] and part not in floors:
            continue
        w, f = warm["parts"].get(part, 0.0), floors.get(part, 0.0)
        print(f"| {part} | {cold['parts'].get(part, 0.0):.1f} | {cold['compiles'].get(part, 0)} "
              f"({cold['compile_s'].get(part, 0.0):.1f}) | {w:.1f} | {computed.get(part, '')} | {f:.1f} | "
              f"{f / w if w else 0:.2f} |")
    print(f"| host (event loop, client, tokenizer, trajectories) | {cold['cpu'] - sum(cold['parts'].values()):.1f} | "
          f"{cold['compiles'].get('outside the sampler', 0)} | {host:.1f} | | 0 | |")
    print(f"| environment server (its own process) | {cold['server']:.1f} | | {warm['server']:.1f} | | 0 | |")
    total_floor = sum(floors.values())
    print(f"| **rollout (this process)** | {cold['cpu']:.1f} | {sum(cold['compiles'].values())} "
          f"({sum(cold['compile_s'].values()):.1f}) | {warm['cpu']:.1f} | | {total_floor:.1f} | "
          f"**{total_floor / warm['cpu']:.2f}** |")
    print(f"summary: rollout_cpu_s={warm['cpu']:.1f} floor_cpu_s={total_floor:.1f} "
          f"floor_fraction={total_floor / warm['cpu']:.3f} cold_rollout_cpu_s={cold['cpu']:.1f}")


if __name__ == "__main__":
    main()
