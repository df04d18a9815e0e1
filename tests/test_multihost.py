"""Multi-host jobs with real processes: `jax.distributed` with 2 processes x 4 CPU devices on
127.0.0.1 (gloo collectives), against one process with 8 devices.

Each process plays its share of the tasks on its own servers and samples on its own devices;
the update runs on global arrays. Every episode's draws fold in its global number (task index x
group size + sample), so sampling at temperature 1 gives each episode the same tokens whichever
process plays it: the two layouts must give the same tokens and, up to float reduction order, the
same metrics. The entropy bonus gives every update a gradient (the tiny policy earns no reward
in one turn), so the params, and with them the later steps' tokens, move with every update.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.parallel.distributed import gather_objects, process_share, share_bounds
from agentgym_jax.rollout import agentgym_format
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.train.metrics import TIMING_KEYS, read_metrics
from tests.rl_runs import with_compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


def test_shares_are_contiguous_cover_every_item_once_and_uneven_splits_are_refused_where_rows_must_match():
    for items, processes in ((8, 2), (3, 2), (7, 3), (1, 4)):
        bounds = [share_bounds(items, processes, k, "tasks", even=False) for k in range(processes)]
        assert bounds[0][0] == 0 and bounds[-1][1] == items
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in process order
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    assert share_bounds(8, 2, 1, "tasks") == (4, 8)
    with pytest.raises(ValueError, match="rollout.batch_tasks: 6 do not split evenly over 4 processes"):
        share_bounds(6, 4, 0, "rollout.batch_tasks")
    assert process_share([5, 6, 7], "tasks", even=False) == ([5, 6, 7], 0)  # one process: everything
    assert gather_objects({"a": [1, 2.5]}) == [{"a": [1, 2.5]}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, process: int | None = None, port: int | None = None, cache: pathlib.Path | None = None,
         ) -> dict[str, str]:
    # Whatever JAX setting the caller has stays out, but the suite's cheap compiles (conftest.py).
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    if cache is not None:  # a restart loads what the killed run compiled
        env = with_compile_cache(env, cache)
    if process is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process))
    return env


class Processes:
    """The processes of one job (their own process groups), reaped on every path."""

    def __init__(self, command: list[str], logs: pathlib.Path, processes: int, cache: pathlib.Path | None = None):
        logs.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        self.logs = [logs / f"p{k}.log" for k in range(processes)]
        self.procs = []
        for k in range(processes):
            env = _env(4, k, port, cache) if processes > 1 else _env(8, cache=cache)
            with open(self.logs[k], "w") as out:
                self.procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def wait(self, timeout: float) -> list[str]:
        """Every process's output once all exited 0; fails (after killing all) otherwise."""
        deadline = time.time() + timeout
        while any(p.poll() is None for p in self.procs):
            failed = [p for p in self.procs if p.poll() not in (None, 0)]
            assert not failed and time.time() < deadline, f"a process failed or hung:\n{self.tail()}"
            time.sleep(0.5)
        assert all(p.returncode == 0 for p in self.procs), self.tail()
        return [log.read_text() for log in self.logs]

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


# Each process: the policy's float32 params sharded over all 8 devices of both processes, then
# the weights its sampler reads (`setup.local_policy`) and one greedy turn sampled with them.
SAMPLER_WEIGHTS = """
import json, pathlib, jax, numpy as np
from jax.experimental import multihost_utils
from agentgym_jax.job import setup
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.parallel import distributed
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler
from configs import quickstart

distributed.initialize_distributed()
config = quickstart.get_config()
config.model.compute_dtype = "bfloat16"
model = ModelConfig.small("qwen2", vocab_size=128, hidden_size=64, intermediate_size=128)
mesh = make_mesh(1, -1, 1)
job = setup.Job(pathlib.Path("."), mesh, setup.sampler_mesh(config), config.env, {}, {})
params = setup.initial_params(config, model, mesh, jax.random.PRNGKey(0), value_head=True)
weights = setup.local_policy(config, job, params)
sampler = Sampler.sharded_decoder(model, SamplingConfig(max_new_tokens=4, temperature=0.0), job.sampler_mesh,
                                  max_cache_len=64, dtype="bfloat16")
full = multihost_utils.process_allgather({k: v for k, v in params.items() if k != "value_head"}, tiled=True)
embed = weights["embed"]["embedding"]
state, turn = sampler.generate(weights, sampler.prefill(weights, [[1, 2, 3], [4, 5]]), jax.random.PRNGKey(1))
print("RESULT " + json.dumps({
    "keys": sorted(weights), "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(weights)}),
    "placed": jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, weights, sampler.shardings.params)),
    "local": all(d.process_index == jax.process_index() for x in jax.tree.leaves(weights) for d in x.sharding.device_set),
    "embed_shards": sorted({s.data.shape for s in embed.addressable_shards}), "embed_shape": embed.shape,
    "equal": jax.tree.leaves(jax.tree.map(lambda w, f: bool(np.array_equal(np.asarray(w), np.asarray(f).astype(w.dtype))),
                                          weights, full)),
    "same_copy": all(a is b for a, b in zip(jax.tree.leaves(sampler.sampling_params(weights)), jax.tree.leaves(weights))),
    "tokens": turn.tokens.tolist(),
}))
"""


@pytest.mark.slow
def test_each_process_s_sampler_reads_compute_dtype_weights_sharded_over_its_own_devices(tmp_path):
    """No float32 copy and no whole replica per device: each device holds its shard of the
    bfloat16 weights (the value head left out), in the sampler's own layout, which samples."""
    with Processes([sys.executable, "-c", SAMPLER_WEIGHTS], tmp_path, 2) as job:
        logs = job.wait(300)
    results = [json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[7:]) for log in logs]
    for r in results:
        assert r["keys"] == ["embed", "final_norm", "layers", "lm_head"] and r["dtypes"] == ["bfloat16"]
        assert all(r["placed"]) and r["local"] and all(r["equal"]) and r["same_copy"]
        assert r["embed_shards"] == [[32, 64]] and r["embed_shape"] == [128, 64]  # vocab split over 4 local devices
    assert results[0]["tokens"] == results[1]["tokens"]  # the same prompts: the same greedy turn


def _launch(config: str, overrides: dict) -> list[str]:
    return [sys.executable, "-m", "agentgym_jax.launch", f"--config=configs/{config}"] + [
        f"--config.{k}={v}" for k, v in overrides.items()
    ]


def _rl_command(workdir: pathlib.Path, **overrides) -> list[str]:
    """tests/test_rl_job.py's tiny job (one layer), one sample per task at temperature 1, 4 tasks
    (2 per process), one turn per episode; the horizon schedule's stage changes at step 2."""
    return _launch("quickstart.py", {
        "workdir": workdir, "seed": 3,
        "train.steps": STEPS, "train.checkpoint_every": 1, "train.keep_checkpoints": 10,
        "sft.num_tasks": 4, "sft.epochs": 2, "sft.batch_size": 4,
        "eval.num_tasks": 2, "eval.horizon": 1,
        "rollout.batch_tasks": 4, "rollout.group_size": 1, "rollout.lock_step": True, "rollout.temperature": 1.0,
        "rollout.max_tokens_per_turn": 8, "rollout.max_cache_len": 512,
        "algo.advantage": "reinforce_plus_plus", "algo.num_minibatches": 1,
        "algo.entropy_coef": 0.1,  # a gradient at every step, whatever the (here all-zero) rewards
        "horizon_schedule.horizons": "(1,1)", "horizon_schedule.steps_per_stage": 2,
        "model.num_layers": 1, "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 8,
        "tokenizer.vocab_size": 320, **overrides,
    })


def _episodes(paths) -> dict[tuple[int, int, int], tuple]:
    """(policy_version, group, sample) -> (task, status, tokens) over the files; each once."""
    out = {}
    for path in paths:
        for t in read_jsonl(str(path)):
            key = (t.policy_version, t.group_id, t.sample_idx)
            assert key not in out, f"{key} recorded twice"
            out[key] = (t.task_id, t.status.value, tuple(t.token_ids))
    return out


def _metrics(workdir: pathlib.Path) -> dict[int, dict]:
    records = read_metrics(str(workdir / "metrics.jsonl"))
    by_step = {r["step"]: {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records}
    assert len(by_step) == len(records), "a step logged twice"
    return by_step


@pytest.mark.slow
def test_rl_on_two_processes_matches_one_process_and_resumes_after_sigkill(tmp_path):
    one, two, cache = tmp_path / "one", tmp_path / "two", tmp_path / "jax_cache"
    # The one-process job runs beside the two-process one (independent workdirs and servers).
    with Processes(_rl_command(one), tmp_path / "logs_one", 1) as reference:
        with Processes(_rl_command(two), tmp_path / "logs_two", 2, cache) as job:  # SIGKILL both after checkpoint 2
            deadline = time.time() + 600
            while not (two / "checkpoints" / "2").is_dir():  # complete: orbax renames tmp dirs
                assert all(p.poll() is None for p in job.procs) and time.time() < deadline, job.tail()
                time.sleep(0.2)
        assert not (two / "checkpoints" / str(STEPS)).exists()
        reference.wait(600)
    with Processes(_rl_command(two), tmp_path / "logs_resumed", 2, cache) as job:  # the same command
        p0, p1 = job.wait(600)
    assert "summary: env=room" in p0 and "summary:" not in p1  # process 0 reports

    a, b = _metrics(one), _metrics(two)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert sorted(a[step]) == sorted(b[step])
        for key in a[step]:
            # A step whose advantages cancel has a gradient of pure float noise (~1e-6 here), and the
            # noise depends on the layout's reduction order: its norm is compared in absolute terms.
            atol = 1e-5 if key == "grad_norm" else 1e-6
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-4, atol=atol, err_msg=f"step {step} {key}")
    assert a[STEPS]["status/success"] + a[STEPS]["status/failure"] + a[STEPS]["status/max_turns"] == 4
    # float noise is ~1e-6: every update moved the params, so the later steps' tokens depend on it
    assert min(a[s]["grad_norm"] for s in a) > 1e-4

    assert not (two / "trajectories.jsonl").exists()  # one file per process, never one shared
    ea = _episodes([one / "trajectories.jsonl"])
    eb = _episodes([two / "trajectories.p0.jsonl", two / "trajectories.p1.jsonl"])
    assert ea == eb and len(ea) == 4 * STEPS
    p0_groups = {g for _, g, _ in _episodes([two / "trajectories.p0.jsonl"])}
    assert p0_groups == {0, 1}  # process 0 played the first half of every step's tasks
    report = json.loads((two / "report.json").read_text())
    assert report["success_after"] == json.loads((one / "report.json").read_text())["success_after"]


@pytest.mark.slow
def test_async_rl_on_two_processes_matches_one_process(tmp_path):
    """One-step-off, lock-step (`rollout.max_staleness=1`): each process streams its share of every
    batch's groups, numbered over both; the updates, episodes and stream positions (each process's,
    in the checkpoint) are those of the same job on one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    overrides = {"train.steps": 3, "rollout.max_staleness": 1, "rollout.num_slots": 4, "algo.decoupled_ppo": True}
    with Processes(_rl_command(one, **overrides), tmp_path / "logs_one", 1) as reference:
        with Processes(_rl_command(two, **overrides), tmp_path / "logs_two", 2) as job:
            job.wait(600)
        reference.wait(600)
    a, b = _metrics(one), _metrics(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [a[s]["staleness_max"] for s in a] == [0, 1, 1]
    for step in a:
        for key in a[step]:
            atol = 1e-5 if key == "grad_norm" else 1e-6
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-4, atol=atol, err_msg=f"step {step} {key}")
    ea = _episodes([one / "trajectories.jsonl"])
    eb = _episodes([two / "trajectories.p0.jsonl", two / "trajectories.p1.jsonl"])
    assert ea == eb and len(ea) == 4 * 3
    assert {g for _, g, _ in _episodes([two / "trajectories.p0.jsonl"])} == {0, 1, 4, 5, 8, 9}  # its half of each batch
    def pending(workdir: pathlib.Path) -> list[tuple[int, list[int]]]:  # each process's stream after step 2
        meta = json.loads((workdir / "checkpoints" / "2" / "meta" / "metadata").read_text())
        return [(e["next_batch"], [g["index"] for g in e["pending"]]) for e in meta["episodes"]]

    assert pending(one) == [(3, [8, 9, 10, 11])] and pending(two) == [(3, [8, 9]), (3, [10, 11])]  # batch 2 in flight


def _sft_data(path: pathlib.Path) -> None:
    """AgentTraj-L-style conversations of six room tasks (the SFT job builds its tokenizer on them)."""
    items = [{"item_id": f"room_{i}", "success": 1, "conversations": [
        {"from": "human", "loss": None, "value": "You are in a house. Answer with Action: go to <room>."},
        {"from": "gpt", "loss": True, "value": f"Action: go to room {i}"},
        {"from": "human", "loss": None, "value": f"You are in room {i}."},
        {"from": "gpt", "loss": True, "value": f"Action: go to room {i + 1}"},
    ]} for i in range(6)]
    agentgym_format.write_file(path, items)


@pytest.mark.slow
def test_sft_then_eval_on_two_processes_match_one_process(tmp_path):
    data = tmp_path / "room.json"
    _sft_data(data)
    sft = {"data.agentgym": data, "train.steps": 3, "train.batch_size": 4, "train.checkpoint_every": 3,
           "env.name": "room", "eval.num_tasks": 2, "eval.horizon": 2,
           "rollout.max_tokens_per_turn": 4, "rollout.max_cache_len": 256,
           "tokenizer.vocab_size": 300, "model.num_layers": 1, "model.hidden_size": 32,
           "model.intermediate_size": 64, "model.head_dim": 8, "seed": 1}
    results = {}
    for n in (1, 2):
        run = tmp_path / f"sft{n}"
        with Processes(_launch("sft.py", {**sft, "workdir": run}), tmp_path / f"logs_sft{n}", n) as job:
            job.wait(300)
        out = tmp_path / f"eval{n}"
        eval_args = {"policy": f"checkpoint:{run}", "envs": "room", "task_ids": 3, "horizon": 2,
                     "rollout.max_tokens_per_turn": 4, "rollout.max_cache_len": 256, "out_dir": out}
        with Processes(_launch("eval.py", eval_args), tmp_path / f"logs_eval{n}", n) as job:
            logs = job.wait(300)
        results[n] = (_metrics(run), json.loads((out / "summary.json").read_text())["overall"], out, logs,
                      json.loads((run / "eval.json").read_text()))
    (m1, s1, out1, _, in_job1), (m2, s2, out2, logs2, in_job2) = results[1], results[2]
    assert in_job1 == in_job2 and sum(v for k, v in in_job2.items() if k.startswith("status/")) == 2
    assert sorted(m1) == sorted(m2) == [1, 2, 3]
    for step in m1:
        for key in m1[step]:
            np.testing.assert_allclose(m2[step][key], m1[step][key], rtol=1e-4, atol=1e-6, err_msg=f"{step} {key}")
    assert s2["scheduled"] == s1["scheduled"] == 3 and s2["success"] == s1["success"]
    e1 = {(t.task_id, tuple(t.token_ids)) for t in read_jsonl(str(out1 / "trajectories.jsonl"))}
    shares = [list(read_jsonl(str(out2 / f"trajectories.p{k}.jsonl"))) for k in (0, 1)]
    assert sorted(len(s) for s in shares) == [1, 2]  # 3 tasks: contiguous shares of 2 and 1
    assert {(t.task_id, tuple(t.token_ids)) for s in shares for t in s} == e1
    assert "summary: envs=room scheduled=3" in logs2[0] and "summary:" not in logs2[1]


@pytest.mark.slow
def test_a_process_whose_servers_are_dead_ends_its_episodes_infra_error(tmp_path):
    """Process 1's only server is gone: its share ends `infra_error`, process 0's is played, and
    the job reports both once (no hang)."""
    out = tmp_path / "out"
    with LocalServers(["room"]) as servers:
        dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
        urls = f"room={servers.servers[0].url},room={dead}"  # process k takes the k-th
        args = {"policy": "oracle", "envs": "room", "task_ids": 4, "horizon": 20, "out_dir": out, "env.urls": urls,
                "env.request_timeout_s": 5}
        with Processes(_launch("eval.py", args), tmp_path / "logs", 2) as job:
            logs = job.wait(300)
    p0 = list(read_jsonl(str(out / "trajectories.p0.jsonl")))
    p1 = list(read_jsonl(str(out / "trajectories.p1.jsonl")))
    assert [t.status.value for t in p0] == ["success"] * 2  # the oracle solves room
    assert {t.status.value for t in p1} == {"infra_error"}  # every attempt (eval retries infra errors)
    assert len({t.task_id for t in p1}) == 2 and not {t.task_id for t in p0} & {t.task_id for t in p1}
    overall = json.loads((out / "summary.json").read_text())["overall"]
    assert overall["scheduled"] == 4
    assert "infra_rate=0.500" in logs[0] and "summary:" not in logs[1]
