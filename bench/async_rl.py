"""Asynchronous RL: the same job synchronously, one step off and two steps off, side by side.

    python bench/async_rl.py                      # profile miniwob_8, 8 RL steps per mode: ~6-7 minutes
    python bench/async_rl.py --profile=miniwob --steps=6 --out=/tmp/async_rl --set algo.ppo_epochs=2

One RL job (`configs/quickstart.py` with the overrides in `job_overrides`: a tiny random policy, no
SFT, one held-out episode, GRPO with decoupled PPO, the slot engine; `--set key=value` adds more) is
launched on 8 simulated CPU devices with `rollout.max_staleness` 0 (the synchronous loop: sample,
then update), 1 (one step off: the sampler plays the next step's groups while the trainer updates)
and 2, all with `lock_step=False` (the stages overlap), each in its own workdir under `--out`. The
environment is `bench/latency_env.py` on a real local server the three runs share: ragged episodes
(1 to 8 turns, or fewer when the policy says the goal word) whose every step sleeps a latency drawn
from a profile measured on our own servers (`--profile`: MiniWoB++'s Chromium at 1 or 8 sessions,
ScienceWorld's JVM, the code sandbox; constants and commands in that file).

Compilation is kept out of the comparison: the runs share a persistent compilation cache under
`--out` (so most shapes compile once, in the first run's untimed first step), and the XLA
compilations left inside a run's timed steps (`compiles`: new shapes of fills, decodes and
updates, from the job's log) have their seconds (`compile_s`) taken out of its wall. That is
exact for the synchronous loop, where nothing runs beside a compilation; an asynchronous run may
have hidden part of one behind the other thread's work, so the same subtraction favours it by at
most its `compile_s` (the table shows both). The modes' batches differ in shape (an asynchronous
step takes the groups that finish first, so its first batch is shorter and pads to another
length), so no warm-up of one mode covers another's.

Timing is the bench's own: it watches `metrics.jsonl` and stamps each step's line as it appears;
a mode's wall runs from the line of step `--skip` to the last line. Per mode: steps timed,
episodes/s (episodes trained on: the steps' `status/*` counts), tokens/s (policy tokens sampled:
`response_tokens` x episodes), `compiles`, the job's own `rollout_s` (asynchronous: the trainer's
wait for its groups) and `update_s`, its idle fractions of each step's wall (`sampler_idle`: no
sampler call running; `trainer_idle`: the trainer waiting for episodes; `env_wait`: the sampler
waiting on environments), the mean staleness of the groups trained on (updates behind), the
fraction of groups dropped as too stale (of those played to the end), and the speed-up in
episodes/s over the synchronous run. Last line:
`summary: async_speedup=<x> one_step_off_speedup=<y> stale_dropped=<fraction>` (x and the
fraction for max_staleness=2).

Sizing. Asynchrony can hide at most the shorter of the rollout's wall and the update's, so the
speed-up is bounded by (rollout + update) / max(rollout, update): 2 when they are equal. The job
is sized so that the synchronous run's update (4 epochs x 2 mini-batches over 32 episodes, ~6 s
on the 2-core CPU) is comparable to its rollout (up to 8 turns of ~0.5 s latency plus decoding,
~8 s); the script prints both. On a CPU the sampler and the trainer compute on the same cores:
what overlaps is mostly the trainer's compute with the environments' latency (the sampler
waiting on its episodes' steps), not compute with compute, so the script also prints the bound
when no compute overlaps: (rollout + update) / max(rollout, sampler compute + update). With a
tiny model the sampler's compute per turn is comparable to a browser step's latency on this
CPU (bench/README.md), which is what holds the speed-up there; on an accelerator with sampler
devices of its own (`rollout.sampler_devices`) compute overlaps compute too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentgym_jax.envs.launcher import LocalServers  # noqa: E402
from bench import latency_env  # noqa: E402

GROUP_SIZE = 4
MODES = {0: "sync", 1: "one-step-off", 2: "async (k=2)"}  # rollout.max_staleness -> name
PROFILE_ENVS = {"miniwob": "MiniWoBLatencyEnv", "miniwob_8": "MiniWoB8LatencyEnv", "sciworld": "SciWorldLatencyEnv",
                "code": "CodeLatencyEnv"}
# The job's idle fractions of a step's wall (train/rl_loop.py): the sampler computing nothing, the
# trainer waiting for episodes, the sampler waiting on the environments.
_COMPILED = re.compile(r"Finished XLA compilation of .* in ([\d.]+) sec")  # jax_log_compiles' line
IDLE_KEYS = {"sampler_idle": "sampler_idle_fraction", "trainer_idle": "trainer_idle_fraction",
             "env_wait": "sampler_wait_fraction"}


def job_overrides(profile: str, url: str, steps: int, max_staleness: int, workdir: pathlib.Path) -> dict[str, object]:
    """`--config.<key>` overrides of `configs/quickstart.py` for one run of the bench's job, on the
    latency server at `url` (the bench's own, shared by the three runs)."""
    env = getattr(latency_env, PROFILE_ENVS[profile])
    return {
        "workdir": workdir,
        "env.name": env.name,
        "env.urls": url,
        "sft.num_tasks": 0,  # no warm start: the policy is random, which is all a throughput bench needs
        "eval.num_tasks": 1,  # the report needs one held-out episode (0 is refused there)
        "eval.horizon": 1,
        "train.steps": steps,
        "train.checkpoint_every": steps,  # one checkpoint, at the end
        "train.keep_checkpoints": 1,
        "horizon_schedule.kind": "fixed",
        "horizon_schedule.horizons": f"({latency_env.MAX_TURNS},)",
        "rollout.batch_tasks": 8,
        "rollout.group_size": GROUP_SIZE,
        "rollout.num_slots": 32,  # the latency server steps 32 sessions at once (its thread pool)
        "rollout.max_tokens_per_turn": 8,
        "rollout.max_response_length": 512,
        "rollout.max_cache_len": 1024,
        "rollout.lock_step": False,
        "rollout.max_staleness": max_staleness,
        "rollout.stale_groups": "drop",
        "algo.decoupled_ppo": True,
        "algo.ppo_epochs": 4,  # the update about as long as the rollout (see the docstring)
        "algo.num_minibatches": 2,
    }


class Tail:
    """The complete lines appended to a file since the last call, each stamped when first seen."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset, self.partial = path, 0, ""

    def read(self) -> list[tuple[float, str]]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        now = time.monotonic()
        *lines, self.partial = (self.partial + chunk).split("\n")
        return [(now, line) for line in lines]


@dataclasses.dataclass
class Run:
    """One mode's job: its metrics lines and when the bench saw each appear, and its XLA
    compilations as (when seen, seconds) (monotonic; persistent-cache hits are not compilations)."""

    mode: str
    records: list[dict]
    seen_s: list[float]
    compilations: list[tuple[float, float]]
    wall_s: float  # the whole job, start-up and compilation included


def run_job(mode: str, overrides: dict[str, object], log_path: pathlib.Path, cache: pathlib.Path) -> Run:
    """Launches the job (8 simulated devices, a persistent compilation cache shared by every run)
    and stamps each metrics line and each compilation in its log as they are written."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_LOG_COMPILES": "1"}
    cmd = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/quickstart.py"]
    cmd += [f"--config.{key}={value}" for key, value in overrides.items()]
    metrics, log = Tail(pathlib.Path(overrides["workdir"]) / "metrics.jsonl"), Tail(log_path)
    records, seen_s, compilations = [], [], []
    cache_hit = False

    def collect() -> None:
        nonlocal cache_hit
        for now, line in metrics.read():
            records.append(json.loads(line))
            seen_s.append(now)
        for now, line in log.read():
            if (took := _COMPILED.search(line)) and not cache_hit:
                compilations.append((now, float(took[1])))
            cache_hit = "Persistent compilation cache hit" in line

    start = time.monotonic()
    with open(log_path, "w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        while job.poll() is None:
            collect()
            time.sleep(0.02)
        collect()
    if job.returncode != 0:
        raise RuntimeError(f"{mode}: the job exited with code {job.returncode}; its output: {log_path}\n"
                           + log_path.read_text()[-3000:])
    return Run(mode, records, seen_s, compilations, time.monotonic() - start)


@dataclasses.dataclass
class Rates:
    steps: int
    episodes_per_s: float
    tokens_per_s: float
    compilations: int  # XLA compilations inside the timed steps
    compile_s: float  # their seconds, taken out of the wall
    rollout_s: float  # the job's own, mean per timed step (async: the trainer's wait for episodes)
    update_s: float
    sampler_busy_s: float | None  # the sampler computing, mean per timed step (None: not logged)
    idle: dict[str, float | None]  # the job's idle fractions, mean per timed step (None: not logged)
    staleness_mean: float | None  # updates between a trained group's oldest token's weights and the update
    stale_dropped: float | None  # groups dropped as too stale / groups played to the end, in the timed steps


def rates(run: Run, skip: int) -> Rates:
    """Rates over the steps after the first `skip`, timed by the bench's stamps: from the line of
    step `skip` to the last line, less the compilations in between."""
    if len(run.records) <= skip + 1:
        raise RuntimeError(f"{run.mode}: {len(run.records)} steps logged, need more than --skip={skip} + 1")
    timed = run.records[skip + 1:]
    first, last = run.seen_s[skip], run.seen_s[-1]
    compiled = [seconds for seen, seconds in run.compilations if first < seen <= last]
    wall = last - first - sum(compiled)
    episodes = [sum(v for k, v in r.items() if k.startswith("status/")) for r in timed]
    tokens = sum(r.get("response_tokens", 0.0) * n for r, n in zip(timed, episodes))
    for r in timed:
        if "step_s" in r and "sampler_idle_fraction" in r:
            r["sampler_busy_s"] = (1 - r["sampler_idle_fraction"]) * r["step_s"]
    mean = lambda key: sum(r[key] for r in timed) / len(timed) if all(key in r for r in timed) else None  # noqa: E731
    stale_dropped = None
    if "stale_dropped" in run.records[-1]:  # a running count of groups
        dropped = run.records[-1]["stale_dropped"] - run.records[skip].get("stale_dropped", 0)
        stale_dropped = dropped / (dropped + sum(episodes) / GROUP_SIZE)
    return Rates(
        steps=len(timed), episodes_per_s=sum(episodes) / wall, tokens_per_s=tokens / wall,
        compilations=len(compiled), compile_s=sum(compiled),
        rollout_s=mean("rollout_s") or 0.0, update_s=mean("update_s") or 0.0,
        sampler_busy_s=mean("sampler_busy_s"),
        idle={name: mean(key) for name, key in IDLE_KEYS.items()}, staleness_mean=mean("staleness_mean"),
        stale_dropped=stale_dropped,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="miniwob_8", choices=sorted(PROFILE_ENVS))
    parser.add_argument("--steps", type=int, default=8, help="RL steps per mode")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the timing")
    parser.add_argument("--staleness", default="0,1,2", help="the modes to run (rollout.max_staleness values)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another config override for every run, e.g. --set algo.ppo_epochs=4")
    parser.add_argument("--out", default="/tmp/bench_async_rl", help="workdirs (started afresh) and the compilation cache")
    args = parser.parse_args()
    out, cache = pathlib.Path(args.out), pathlib.Path(args.out) / "jax_cache"
    p = latency_env.PROFILES[args.profile]
    print(f"profile {args.profile}: step latency lognormal median {1e3 * p.median_s:.1f} ms, sigma {p.sigma:.3f}, "
          f"clipped at {1e3 * p.max_s:.1f} ms (measured at {p.sessions} session(s): p50/p90/p99 {1e3 * p.p50_s:.1f}/"
          f"{1e3 * p.p90_s:.1f}/{1e3 * p.p99_s:.1f} ms); episodes of 1-{latency_env.MAX_TURNS} turns", flush=True)
    results: dict[str, Rates] = {}
    with LocalServers([f"bench.latency_env:{PROFILE_ENVS[args.profile]}"]) as server:

        def launch(name: str, staleness: int, steps: int) -> Run:
            workdir = out / name
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            overrides = job_overrides(args.profile, server.servers[0].url, steps, staleness, workdir)
            overrides.update(item.split("=", 1) for item in args.set)
            run = run_job(MODES[staleness], overrides, out / f"{name}.log", cache)
            print(f"[{MODES[staleness]}] {name}: {len(run.records)} steps in {run.wall_s:.0f} s, "
                  f"{len(run.compilations)} compilations", flush=True)
            return run

        for staleness in (int(k) for k in args.staleness.split(",")):
            results[MODES[staleness]] = rates(launch(f"staleness{staleness}", staleness, args.steps), args.skip)

    sync = results["sync"].episodes_per_s
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"{'mode':<13} {'steps':>5} {'episodes/s':>10} {'tokens/s':>9} {'compiles':>8} {'compile_s':>9} {'rollout_s':>9} "
          f"{'update_s':>8} {'sampler_idle':>12} {'trainer_idle':>12} {'env_wait':>8} {'staleness':>9} "
          f"{'stale_dropped':>13} {'speedup':>7}")
    for mode, r in results.items():
        print(f"{mode:<13} {r.steps:>5} {r.episodes_per_s:>10.2f} {r.tokens_per_s:>9.1f} {r.compilations:>8} {r.compile_s:>9.1f} "
              f"{r.rollout_s:>9.2f} {r.update_s:>8.2f} {fmt(r.idle['sampler_idle']):>12} {fmt(r.idle['trainer_idle']):>12} "
              f"{fmt(r.idle['env_wait']):>8} {fmt(r.staleness_mean):>9} {fmt(r.stale_dropped):>13} "
              f"{r.episodes_per_s / sync:>7.2f}")
    s = results["sync"]
    line = (f"sync: rollout {s.rollout_s:.2f} s, update {s.update_s:.2f} s a step; overlapping them gives at most "
            f"{(s.rollout_s + s.update_s) / max(s.rollout_s, s.update_s):.2f}x")
    if s.sampler_busy_s is not None:  # what overlaps when the sampler's and the trainer's compute cannot
        line += (f"; the sampler computed {s.sampler_busy_s:.2f} s of the rollout, so with no compute overlapping "
                 f"compute (shared cores) at most {(s.rollout_s + s.update_s) / max(s.rollout_s, s.sampler_busy_s + s.update_s):.2f}x")
    print(line)
    speedup = lambda k: fmt(results[MODES[k]].episodes_per_s / sync if MODES[k] in results else None)  # noqa: E731
    print(f"summary: async_speedup={speedup(2)} one_step_off_speedup={speedup(1)} "
          f"stale_dropped={fmt(results[MODES[2]].stale_dropped if MODES[2] in results else None)}")


if __name__ == "__main__":
    main()
