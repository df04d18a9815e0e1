"""Clean-versus-perturbed evaluation (`config.perturbations`, `eval/perturbed.py`) through real
local servers: Academia's oracle, whose calls a perturbed server fails half the time, on a
horizon with one turn to spare. The gap is checked against the two runs' own records."""

from __future__ import annotations

import json

import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.eval import perturbed, runner
from agentgym_jax.rollout.trajectory import read_jsonl
from tests.test_eval_runner import tiny_config


def test_the_same_tasks_against_clean_and_perturbed_servers_give_the_gap(tmp_path, capsys):
    config = tiny_config(envs="academia", policy="oracle", task_ids="6", group_size=2, horizon=4, out_dir=str(tmp_path))
    config.rollout.action_format = "{action}"  # the oracle writes whole AgentGym calls
    config.perturbations = "tool_failure=0.5"
    clean = runner.run(config)
    assert clean.overall.success.numerator == 12  # the oracle solves every task in three calls

    rates = {}
    for name in ("clean", "tool_failure-0.5"):
        records = list(read_jsonl(str(tmp_path / name / runner.TRAJECTORIES_NAME)))
        assert len(records) == 12
        rates[name] = {t: sum(r.success for r in records if r.task_id == t) / 2 for t in {r.task_id for r in records}}
    assert set(rates["clean"]) == set(rates["tool_failure-0.5"])
    gap = sum(rates["clean"][t] - rates["tool_failure-0.5"][t] for t in rates["clean"]) / len(rates["clean"])
    assert gap > 0  # failing tools cost the oracle its spare turn on some tasks

    record = json.loads((tmp_path / perturbed.JSON_NAME).read_text())
    clean_row, perturbed_row = record["settings"]
    assert clean_row["setting"] == "clean" and "gap" not in clean_row
    assert perturbed_row["setting"] == "tool_failure=0.5"
    assert perturbed_row["gap"]["mean_difference"] == pytest.approx(gap)
    assert perturbed_row["gap"]["num_tasks"] == 6 and perturbed_row["gap"]["losses"] == 0
    # A task's two samples meet the same seeded failures: pass^2 equals pass@1 here.
    assert perturbed_row["pass_hat_2"] == pytest.approx(perturbed_row["pass_at_1"])
    markdown = (tmp_path / perturbed.MARKDOWN_NAME).read_text()
    assert "| setting | success (end-to-end) | pass@1 | pass^2 |" in markdown
    assert f"{gap:+.3f}" in markdown
    assert "pass^2" in (tmp_path / "clean" / "summary.md").read_text()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"summary: envs=academia settings=2 clean_success=1.000 largest_gap={gap:+.3f} out_dir={tmp_path}"


def test_a_server_must_confirm_its_perturbation():
    info = TaskInfo("academia", "", 1.0, {}, 0, metadata={"perturbation": "noise=0.05,truncate=400"})
    perturbed.check_confirmed(info, "truncate=400,noise=.05")  # the same setting, written otherwise
    for setting in ("", "noise=0.05", "noise=0.1,truncate=400"):
        with pytest.raises(ConfigError, match="reports perturbation 'noise=0.05,truncate=400'"):
            perturbed.check_confirmed(info, setting)
    perturbed.check_confirmed(TaskInfo("academia", "", 1.0, {}, 0), "")
    assert perturbed.settings(" noise=0.05 ; tool_failure=0.2 ") == ["", "noise=0.05", "tool_failure=0.2"]
    with pytest.raises(ConfigError, match="twice"):
        perturbed.settings("noise=0.05;noise=0.05")


def test_perturbations_need_local_servers(tmp_path):
    config = tiny_config(envs="academia", policy="oracle", out_dir=str(tmp_path))
    config.perturbations = "noise=0.05"
    config.env.urls = "academia=http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="perturbations start local servers per setting"):
        runner.run(config)
