"""launch/tpu_pod.sh and launch/slurm_gpu.sbatch with fake `gcloud`, `srun`, `scontrol` and
`python3` on PATH: each fake records its argv, working directory and environment, so the tests
see what a pod worker or a SLURM task would run, through every shell the command passes."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from agentgym_jax.parallel import distributed
from tests.servers import REPO

TPU_POD = REPO / "launch" / "tpu_pod.sh"
SLURM = REPO / "launch" / "slurm_gpu.sbatch"
# Overrides a shell would mangle if quoted wrongly: a space, a comma, a quote, a `$`, a glob.
OVERRIDES = ["--config.workdir=/mnt/runs/my run", "--config.env.urls=http://10.0.0.1:8000,http://10.0.0.2:8000",
             "--config.note=it's $HOME *"]

# The TPU script ships the committed tree (`git archive HEAD`), so its runs need a git checkout.
needs_git = pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")

_RECORDER = """#!{python}
import json, os, shutil, subprocess, sys
name = os.path.basename(sys.argv[0])
record = {{"name": name, "argv": sys.argv[1:], "cwd": os.getcwd(),
          "env": {{k: v for k, v in os.environ.items() if k.startswith(("JAX_", "SLURM_", "XLA_"))}}}}
with open({log!r}, "a") as f:
    f.write(json.dumps(record) + "\\n")
if name == "gcloud" and sys.argv[4:5] == ["scp"]:  # copy to the fake worker's home
    shutil.copy(sys.argv[5], os.path.join({remote_home!r}, sys.argv[6].split(":", 1)[1]))
elif name == "scontrol":  # `scontrol show hostnames a,b` -> one host per line
    print("\\n".join(sys.argv[3].split(",")))
elif name == "srun":  # run the command once per task, as SLURM would
    ntasks = int(next(a for a in sys.argv if a.startswith("--ntasks=")).split("=")[1])
    command = sys.argv[next(i for i, a in enumerate(sys.argv) if i and not a.startswith("-")):]
    for rank in range(ntasks):
        subprocess.run(command, check=True, env={{**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0"}})
"""


@pytest.fixture
def fakes(tmp_path: pathlib.Path):
    """A PATH with recording fakes; returns (env, read_log, remote_home)."""
    bin_dir, remote_home, log = tmp_path / "bin", tmp_path / "worker_home", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    remote_home.mkdir()
    for name in ("gcloud", "srun", "scontrol", "python3"):
        path = bin_dir / name
        path.write_text(_RECORDER.format(python=sys.executable, log=str(log), remote_home=str(remote_home)))
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}

    def read_log() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, read_log, remote_home


def _run(script: pathlib.Path, args: list[str], env: dict[str, str], cwd: pathlib.Path = REPO):
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", [TPU_POD, SLURM])
def test_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- Cloud TPU pod --------------------------------------------------------------------------------


@needs_git
def test_tpu_pod_dry_run_prints_the_commands_and_runs_nothing(fakes):
    env, read_log, _ = fakes
    done = _run(TPU_POD, ["configs/quickstart.py", *OVERRIDES],
                {**env, "DRY_RUN": "1", "TPU": "pod-a", "ZONE": "us-east5-a", "PROJECT": "proj"})
    assert done.returncode == 0, done.stderr
    assert read_log() == []
    archive, scp, ssh = [shlex.split(line) for line in done.stdout.strip().splitlines()]
    assert archive[:2] == ["git", "archive"] and archive[-1] == "HEAD"
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-a"]
    assert {"--worker=all", "--zone=us-east5-a", "--project=proj"} <= set(ssh)
    remote = next(a for a in ssh if a.startswith("--command=")).split("=", 1)[1]
    *setup, launch = remote.split(" && ")
    assert shlex.split(launch) == ["python3", "-m", "agentgym_jax.launch", "--config=configs/quickstart.py", *OVERRIDES]
    assert shlex.split(setup[-1]) == ["python3", "-m", "pip", "install", "-q", "-e", ".[tpu,envs]", "-c", "constraints.txt"]
    assert setup[0] == 'export JAX_COMPILATION_CACHE_DIR="$HOME/.cache/agentgym_jax/jax"'  # each worker's own

    shared = _run(TPU_POD, ["configs/quickstart.py"], {**env, "DRY_RUN": "1", "TPU": "pod-a", "ZONE": "z",
                                                         "JAX_COMPILATION_CACHE_DIR": "gs://bucket/my cache"})
    remote = next(a for a in shlex.split(shared.stdout.splitlines()[-1]) if a.startswith("--command=")).split("=", 1)[1]
    assert shlex.split(remote.split(" && ")[0]) == ["export", "JAX_COMPILATION_CACHE_DIR=gs://bucket/my cache"]


@needs_git
def test_tpu_pod_worker_runs_the_config_with_overrides_intact(fakes):
    """Runs the `--command` gcloud got in a fake worker home, through a real shell."""
    env, read_log, remote_home = fakes
    done = _run(TPU_POD, ["configs/quickstart.py", *OVERRIDES], {**env, "TPU": "pod-a", "ZONE": "us-east5-a"})
    assert done.returncode == 0, done.stderr
    scp, ssh = read_log()
    assert scp["argv"][3] == "scp" and ssh["argv"][:5] == ["compute", "tpus", "tpu-vm", "ssh", "pod-a"]
    assert "--worker=all" in ssh["argv"] and "--zone=us-east5-a" in ssh["argv"]
    assert not [a for a in ssh["argv"] if a.startswith("--project")]
    assert not list(pathlib.Path(env["TMPDIR"]).glob("agentgym_jax-*.tar.gz"))  # local archive removed

    command = next(a for a in ssh["argv"] if a.startswith("--command=")).split("=", 1)[1]
    worker = subprocess.run(["bash", "-c", command], cwd=remote_home, env=env, capture_output=True, text=True, timeout=60)
    assert worker.returncode == 0, worker.stderr
    pip, launch = read_log()[2:]
    checkout = remote_home / "agentgym_jax"
    assert (checkout / "setup.py").read_text() == (REPO / "setup.py").read_text()  # the committed tree
    assert pip["cwd"] == launch["cwd"] == str(checkout)
    assert pip["argv"] == ["-m", "pip", "install", "-q", "-e", ".[tpu,envs]", "-c", "constraints.txt"]
    assert launch["argv"] == ["-m", "agentgym_jax.launch", "--config=configs/quickstart.py", *OVERRIDES]
    assert launch["env"]["JAX_COMPILATION_CACHE_DIR"] == f"{env['HOME']}/.cache/agentgym_jax/jax"


def test_tpu_pod_needs_its_settings(fakes, tmp_path):
    env, read_log, _ = fakes
    not_git = tmp_path / "copy"
    (not_git / "launch").mkdir(parents=True)
    (not_git / "launch" / "tpu_pod.sh").write_text(TPU_POD.read_text())
    outside = _run(not_git / "launch" / "tpu_pod.sh", ["configs/quickstart.py"],
                   {**env, "TPU": "pod-a", "ZONE": "z", "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert outside.returncode == 1 and "not a git checkout" in outside.stderr
    no_zone = _run(TPU_POD, ["configs/quickstart.py"], {**env, "TPU": "pod-a"})
    assert no_zone.returncode != 0 and "ZONE" in no_zone.stderr
    no_config = _run(TPU_POD, [], {**env, "TPU": "pod-a", "ZONE": "z"})
    assert no_config.returncode == 2 and "usage" in no_config.stderr
    assert read_log() == []


# -- SLURM, multi-node GPU ------------------------------------------------------------------------

SLURM_ENV = {"SLURM_JOB_NODELIST": "gpu-a17,gpu-b03", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}


def test_slurm_dry_run_prints_the_coordinator_and_the_srun_command(fakes, tmp_path):
    env, read_log, _ = fakes
    done = _run(SLURM, ["configs/quickstart.py", *OVERRIDES],
                {**env, **SLURM_ENV, "DRY_RUN": "1", "COORDINATOR_PORT": "4567", "SLURM_SUBMIT_DIR": str(REPO)},
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in read_log()] == ["scontrol"]  # srun is printed, not run
    coordinator, processes, *memory, srun = done.stdout.strip().splitlines()
    assert coordinator == "JAX_COORDINATOR_ADDRESS=gpu-a17:4567" and processes == "JAX_NUM_PROCESSES=2"
    assert memory == ["XLA_PYTHON_CLIENT_PREALLOCATE=true", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95",
                      f"JAX_COMPILATION_CACHE_DIR={REPO}/.jax_cache"]
    srun = shlex.split(srun)
    assert srun[0] == "srun" and {"--ntasks=2", "--nodes=2", "--ntasks-per-node=1"} <= set(srun)
    launch = ["python", "-m", "agentgym_jax.launch", "--config=configs/quickstart.py", *OVERRIDES]
    assert srun[-len(launch) - 3:] == ["-c", srun[-len(launch) - 2], "agentgym_jax", *launch]


def test_slurm_tasks_get_the_coordinator_process_ids_and_all_node_gpus(fakes, tmp_path, monkeypatch):
    env, read_log, _ = fakes
    done = _run(SLURM, ["configs/quickstart.py", *OVERRIDES],
                {**env, **SLURM_ENV, "PYTHON": "python3", "SLURM_SUBMIT_DIR": str(REPO),
                 "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    calls = read_log()
    assert [c["name"] for c in calls] == ["scontrol", "srun", "python3", "python3"]
    tasks = calls[2:]
    for rank, task in enumerate(tasks):
        assert task["cwd"] == str(REPO)
        assert task["argv"] == ["-m", "agentgym_jax.launch", "--config=configs/quickstart.py", *OVERRIDES]
        assert task["env"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3"  # not SLURM_LOCALID's single GPU
        assert task["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
        assert task["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"  # the caller's, kept
        assert task["env"]["JAX_COMPILATION_CACHE_DIR"] == f"{REPO}/.jax_cache"  # shared by the nodes

        # What agentgym_jax/parallel/distributed.py makes of that task's environment.
        seen = {}
        monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
        monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: seen.update(kw))
        assert distributed.initialize_distributed(task["env"]) is True
        assert seen == {"coordinator_address": "gpu-a17:12345", "num_processes": 2, "process_id": rank}


def test_slurm_script_refuses_to_run_outside_an_allocation(fakes):
    env, read_log, _ = fakes
    done = _run(SLURM, ["configs/quickstart.py"], env)
    assert done.returncode != 0 and "sbatch" in done.stderr
    assert read_log() == []
