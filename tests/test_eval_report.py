"""Evaluation reports: JSON and Markdown content, PNG plots that matplotlib can read back."""

import json
import os

import matplotlib.image
import pytest

from agentgym_jax.envs.protocol import EpisodeStatus as S
from agentgym_jax.eval import accounting as acc
from agentgym_jax.eval import paired, report


def rec(env, task, status, turns, reward=None, sample=0):
    reward = (1.0 if status == S.SUCCESS else 0.0) if reward is None else reward
    return acc.EpisodeRecord(env, task, sample, 0, reward, S(status), turns, 0)


@pytest.fixture(scope="module")
def summary():
    records = [rec("maze", t, S.SUCCESS, turns=2 + t % 3) for t in range(6)]
    records += [rec("maze", t, S.FAILURE, turns=5) for t in range(6, 9)]
    records += [rec("maze", 9, S.INFRA_ERROR, turns=1)]
    records += [rec("sciworld", 0, S.SUCCESS, turns=7, reward=100.0), rec("sciworld", 1, S.MAX_TURNS, 9, 40.0)]
    return acc.summarize(records, {"maze": 1.0, "sciworld": 100.0}, group_size=1)


def test_json_and_markdown_content(summary, tmp_path):
    rates = {("maze", t): 1.0 for t in range(10)}
    comparison = paired.compare_runs(rates, acc.task_success_rates(summary.episodes[:10]), num_bootstrap=100)
    paths = report.write_report(summary, str(tmp_path), comparison)
    data = json.loads(open(paths[report.JSON_NAME]).read())
    maze = data["per_env"]["maze"]
    assert maze["success"]["numerator"] == 6 and maze["success"]["denominator"] == 10
    assert maze["conditional_success"]["denominator"] == 9
    assert maze["infra_rate"]["value"] == pytest.approx(0.1)
    assert maze["status_counts"]["infra_error"] == 1
    assert data["per_env"]["sciworld"]["mean_score"] == pytest.approx(70.0)
    assert data["overall"]["scheduled"] == 12 and data["overall"]["mean_score"] is None
    assert data["overall"]["pass_at_k"] == {"1": pytest.approx(7 / 12)}
    assert data["paired_comparison"]["wins"] == 4 and data["paired_comparison"]["losses"] == 0

    markdown = open(paths[report.MARKDOWN_NAME]).read()
    lines = markdown.splitlines()
    header = lines[0].split(" | ")
    assert "success (end-to-end)" in header and "conditional success (scored only)" in header
    assert all(line.count("|") == lines[0].count("|") for line in lines[1:5])  # a well-formed table
    maze_row = next(line for line in lines if line.startswith("| maze |"))
    assert "60.0% [31.3, 83.2] (6/10)" in maze_row  # Wilson 95% for 6/10
    assert "66.7%" in maze_row and "(6/9)" in maze_row and "10.0%" in maze_row
    overall_row = next(line for line in lines if line.startswith("| overall |"))
    assert "(7/12)" in overall_row and "| — |" in overall_row  # no mean score across scales
    assert "Paired comparison" in markdown and "4/0/6" in markdown
    assert "Warning" not in markdown
    wrong = acc.summarize([rec("maze", 0, S.FAILURE, 3, reward=1.0)], {"maze": 1.0}, group_size=1)
    assert "**Warning:** 1 scored episode(s) have a status that disagrees" in report.markdown_table(wrong)


def test_plots_are_valid_pngs(summary, tmp_path):
    paths = report.write_report(summary, str(tmp_path / "out"))
    for name in (report.BARS_NAME, report.TURNS_NAME):
        assert os.path.getsize(paths[name]) > 1000
        with open(paths[name], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(paths[name])
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.01  # something was drawn


def test_an_environment_with_only_infra_errors(tmp_path):
    records = [rec("babyai", t, S.INFRA_ERROR, turns=0) for t in range(3)] + [rec("maze", 0, S.SUCCESS, 2)]
    summary = acc.summarize(records, {"babyai": 1.0, "maze": 1.0}, group_size=1)
    paths = report.write_report(summary, str(tmp_path))
    data = json.loads(open(paths[report.JSON_NAME]).read())["per_env"]["babyai"]
    assert data["conditional_success"] == {"numerator": 0, "denominator": 0, "value": None, "low": None, "high": None}
    assert data["success"]["value"] == 0.0 and data["infra_rate"]["value"] == 1.0 and data["mean_turns"] is None
    row = next(line for line in open(paths[report.MARKDOWN_NAME]) if line.startswith("| babyai |"))
    assert row.split(" | ")[3] == "—"  # conditional success over no scored episode is not 0
    assert all(os.path.getsize(paths[name]) > 1000 for name in (report.BARS_NAME, report.TURNS_NAME))


def test_success_within_turns(summary):
    maze = [e for e in summary.episodes if e.env == "maze"]
    ts, shares = report.success_within_turns(maze)
    assert ts == list(range(6))
    # Successes at turns 2, 3, 4, 2, 3, 4 out of 10 scheduled episodes.
    assert shares == pytest.approx([0, 0, 0.2, 0.4, 0.6, 0.6])
