"""Asynchronous RL: the same job synchronously, one step off and two steps off, side by side.

    python bench/async_rl.py                      # profile miniwob, 8 RL steps per mode, ~10 minutes
    python bench/async_rl.py --profile=sciworld --steps=6 --out=/tmp/async_rl

One RL job (`configs/quickstart.py` with the overrides in `job_overrides`: a tiny random policy, no
SFT, no evaluation, GRPO with decoupled PPO, the slot engine) is launched three times on 8
simulated CPU devices, each in its own workdir under `--out`: `rollout.max_staleness` 0 (the
synchronous loop: sample, then update), 1 (one step off: the sampler plays the next step's
episodes while the trainer updates) and 2, all with `lock_step=False` (the stages overlap). The
environment is `bench/latency_env.py` on a real local server: ragged episodes (1 to 8 turns, or
fewer when the policy says the goal word) whose every step sleeps a latency drawn from a profile
measured on our own servers (`--profile`: MiniWoB++'s Chromium, ScienceWorld's JVM, the code
sandbox; the constants and the command that measured them are in that file).

Timing is the bench's own: it watches `metrics.jsonl` and stamps each step's line as it appears,
so a mode's wall is the time from the line of step `--skip` (the first steps compile) to the last
line, whatever the job logs. Per mode it prints steps timed, episodes/s (episodes trained on, the
step's `status/*` counts), tokens/s (policy tokens sampled: `response_tokens` x episodes), the
job's own rollout and update seconds, the idle fractions the async job logs (sampler, trainer,
the sampler's wait on environments; `-` where the job does not log it), the fraction of groups
dropped as too stale, and the speed-up in episodes/s over the synchronous run. Last line:
`summary: async_speedup=<x> one_step_off_speedup=<y> stale_dropped=<fraction>` (x for
max_staleness=2, the fraction of its groups dropped).

Sizing. Asynchrony can hide at most the shorter of the rollout's wall and the update's, so the
speed-up is bounded by (rollout + update) / max(rollout, update): 2 when the two are equal. The
job is sized so that on the 2-core CPU the synchronous run's update (`update_s`, 4 optimizer
updates over 64 episodes) is comparable to its rollout (`rollout_s`, up to 8 turns of measured
latency plus decoding); both are printed for the synchronous run. On a CPU the sampler and the
trainer compute on the same cores, so what overlaps is the trainer's compute with the
environments' latency (the sampler sleeping on its episodes' steps), not compute with compute;
the sampler's own decode time still competes with the update. On an accelerator with sampler
devices of its own (`rollout.sampler_devices`) both overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentgym_jax.envs.launcher import LocalServers  # noqa: E402
from bench import latency_env  # noqa: E402

MODES = {"sync": 0, "one-step-off": 1, "async (k=2)": 2}  # name -> rollout.max_staleness
PROFILE_ENVS = {"miniwob": "MiniWoBLatencyEnv", "miniwob_8": "MiniWoB8LatencyEnv", "sciworld": "SciWorldLatencyEnv",
                "code": "CodeLatencyEnv"}
IDLE_KEYS = ("sampler_idle_fraction", "trainer_idle_fraction", "env_wait_fraction")


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
        "rollout.group_size": 4,
        "rollout.num_slots": 32,  # the latency server steps 32 sessions at once (its thread pool)
        "rollout.max_tokens_per_turn": 8,
        "rollout.max_response_length": 512,
        "rollout.max_cache_len": 1024,
        "rollout.lock_step": False,
        "rollout.max_staleness": max_staleness,
        "rollout.stale_groups": "drop",
        "algo.decoupled_ppo": True,
        "algo.ppo_epochs": 2,
        "algo.num_minibatches": 2,
    }


@dataclasses.dataclass
class Run:
    """One mode's job: its metrics lines and when the bench saw each appear (monotonic seconds)."""

    mode: str
    records: list[dict]
    seen_s: list[float]
    wall_s: float  # the whole job, start-up and compilation included


def run_job(mode: str, overrides: dict[str, object], log_path: pathlib.Path) -> Run:
    """Launches the job (8 simulated devices) and stamps each metrics line as it is written."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/quickstart.py"]
    cmd += [f"--config.{key}={value}" for key, value in overrides.items()]
    metrics_path = pathlib.Path(overrides["workdir"]) / "metrics.jsonl"
    records: list[dict] = []
    seen_s: list[float] = []
    start = time.monotonic()
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        done = threading.Event()

        def watch() -> None:  # a line is written and fsynced by the job once per step
            offset, partial = 0, ""
            while not done.is_set() or offset < (metrics_path.stat().st_size if metrics_path.exists() else 0):
                if metrics_path.exists():
                    with open(metrics_path) as f:
                        f.seek(offset)
                        chunk = f.read()
                        offset = f.tell()
                    now = time.monotonic()
                    *lines, partial = (partial + chunk).split("\n")
                    for line in lines:
                        records.append(json.loads(line))
                        seen_s.append(now)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        code = job.wait()
        done.set()
        watcher.join()
    if code != 0:
        raise RuntimeError(f"{mode}: the job exited with code {code}; its output: {log_path}\n"
                           + log_path.read_text()[-3000:])
    return Run(mode, records, seen_s, time.monotonic() - start)


@dataclasses.dataclass
class Rates:
    steps: int
    episodes_per_s: float
    tokens_per_s: float
    rollout_s: float  # the job's own, mean per timed step
    update_s: float
    idle: dict[str, float | None]  # the async job's idle fractions, mean per timed step (None: not logged)
    stale_dropped: float | None  # the async job's share of groups dropped as too stale (None: not logged)


def rates(run: Run, skip: int) -> Rates:
    """Rates over the steps after the first `skip` (compilation), timed by the bench's stamps."""
    if len(run.records) <= skip + 1:
        raise RuntimeError(f"{run.mode}: {len(run.records)} steps logged, need more than --skip={skip} + 1")
    timed = run.records[skip + 1:]
    wall = run.seen_s[-1] - run.seen_s[skip]
    episodes = [sum(v for k, v in r.items() if k.startswith("status/")) for r in timed]
    tokens = sum(r.get("response_tokens", 0.0) * n for r, n in zip(timed, episodes))
    mean = lambda key: sum(r[key] for r in timed) / len(timed) if all(key in r for r in timed) else None  # noqa: E731
    return Rates(
        steps=len(timed), episodes_per_s=sum(episodes) / wall, tokens_per_s=tokens / wall,
        rollout_s=mean("rollout_s") or 0.0, update_s=mean("update_s") or 0.0,
        idle={key: mean(key) for key in IDLE_KEYS}, stale_dropped=mean("stale_dropped"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="miniwob_8", choices=sorted(PROFILE_ENVS))
    parser.add_argument("--steps", type=int, default=8, help="RL steps per mode")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the timing (compilation)")
    parser.add_argument("--out", default="/tmp/bench_async_rl", help="workdirs, one per mode (started afresh)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    p = latency_env.PROFILES[args.profile]
    print(f"profile {args.profile}: step latency lognormal median {1e3 * p.median_s:.1f} ms, sigma {p.sigma:.3f}, "
          f"clipped at {1e3 * p.max_s:.1f} ms (measured p50/p90/p99 {1e3 * p.p50_s:.1f}/{1e3 * p.p90_s:.1f}/"
          f"{1e3 * p.p99_s:.1f} ms); episodes of 1-{latency_env.MAX_TURNS} turns", flush=True)
    results: dict[str, Rates] = {}
    with LocalServers([f"bench.latency_env:{PROFILE_ENVS[args.profile]}"]) as server:
        url = server.servers[0].url
        for mode, staleness in MODES.items():
            workdir = out / f"staleness{staleness}"
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            overrides = job_overrides(args.profile, url, args.steps, staleness, workdir)
            run = run_job(mode, overrides, out / f"staleness{staleness}.log")
            results[mode] = rates(run, args.skip)
            r = results[mode]
            print(f"[{mode}] {len(run.records)} steps in {run.wall_s:.0f} s; timed {r.steps}: rollout_s "
                  f"{r.rollout_s:.2f}, update_s {r.update_s:.2f} per step (the job's own)", flush=True)

    sync = results["sync"].episodes_per_s
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"{'mode':<13} {'steps':>5} {'episodes/s':>10} {'tokens/s':>9} {'rollout_s':>9} {'update_s':>8} "
          f"{'sampler_idle':>12} {'trainer_idle':>12} {'env_wait':>8} {'stale_dropped':>13} {'speedup':>7}")
    for mode, r in results.items():
        print(f"{mode:<13} {r.steps:>5} {r.episodes_per_s:>10.2f} {r.tokens_per_s:>9.1f} {r.rollout_s:>9.2f} "
              f"{r.update_s:>8.2f} {fmt(r.idle['sampler_idle_fraction']):>12} {fmt(r.idle['trainer_idle_fraction']):>12} "
              f"{fmt(r.idle['env_wait_fraction']):>8} {fmt(r.stale_dropped):>13} {r.episodes_per_s / sync:>7.2f}")
    k2, k1 = results["async (k=2)"], results["one-step-off"]
    print(f"summary: async_speedup={k2.episodes_per_s / sync:.2f} one_step_off_speedup={k1.episodes_per_s / sync:.2f} "
          f"stale_dropped={fmt(k2.stale_dropped)}")


if __name__ == "__main__":
    main()
