"""The RL job's report: the before/after table, `report.json`, the summary line and the curve.

`report.json` holds the held-out results before and after RL (per task, with Wilson 95%
intervals) and the run's `minutes`: its time to the result over every process that ran it (a
resumed process adds its own time to the time its checkpoint had taken; steps redone after a
kill count once). A resumed run also records its last process's own time (`process_minutes`)
and the step it resumed at. Re-running a finished job prints this report again and changes
nothing (`finished_report`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no backend or global figure state to touch

from agentgym_jax.stats import wilson_interval
from agentgym_jax.train.metrics import read_metrics

REPORT_NAME = "report.json"
CURVE_NAME = "learning_curve.png"
TABLE_ROWS = ("success_rate", "mean_reward", "turns", "invalid_action_rate")


def build_report(
    *, env: str, seed: int, steps: int, reward_shaping: str, before: Mapping[str, Any], after: Mapping[str, Any],
    minutes: float, process_minutes: float, resumed_from_step: int | None, curriculum: Mapping[str, Any] | None = None,
    grading: tuple[str, Sequence[float]] | None = None, sampled: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record `report.json` holds (`before`/`after`: `job.play.evaluation_metrics` of the held-out
    evaluations; `curriculum`: the pass-rate controls' `Steered.summary()`, if the run had them;
    `grading`: (name, one grade per task id) for held-out success by grade; `sampled`: `temperature`,
    `samples` a task and the `before`/`after` metrics of the sampled evaluation, `eval.sampled`)."""
    intervals = _intervals(before, after)
    record = {
        "before": dict(before), "after": dict(after),
        "success_before": before["success_rate"], "success_after": after["success_rate"], "wilson_95": intervals,
        "env": env, "seed": seed, "steps": steps, "reward_shaping": reward_shaping,
        "minutes": minutes, "process_minutes": process_minutes, "resumed_from_step": resumed_from_step,
    }
    if curriculum:
        record["curriculum"] = dict(curriculum)
    if sampled:  # Wilson intervals over episodes: a task's samples are not independent, so these are narrow
        record["sampled"] = {**sampled, "success_before": sampled["before"]["success_rate"],
                             "success_after": sampled["after"]["success_rate"],
                             "wilson_95": _intervals(sampled["before"], sampled["after"])}
    if grading:
        name, graded = grading
        record["success_by_grade"] = {"grade": name, **{
            phase: _by_grade(result["task_success"], graded) for phase, result in (("before", before), ("after", after))}}
    return record


def _intervals(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Wilson 95% intervals of the success of two evaluations' episodes."""
    return {name: wilson_interval(sum(s for _, s in result["task_success"]), len(result["task_success"]))
            for name, result in (("before", before), ("after", after))}


def task_grades(metadata: Mapping[str, Any], key: str) -> tuple[str, Sequence[float]] | None:
    """(key, one grade per task id) where the environment grades its tasks by `key`, else None."""
    return (key, metadata[key]) if key and key in metadata else None


def _by_grade(task_success: Sequence[Sequence[int]], graded: Sequence[float]) -> dict[str, list[int]]:
    """`{grade: [successes, episodes]}` of an evaluation's `[task_id, success]` pairs."""
    out: dict[Any, list[int]] = {}
    for task, success in task_success:
        counts = out.setdefault(graded[task], [0, 0])
        counts[0] += success
        counts[1] += 1
    return {str(grade): out[grade] for grade in sorted(out, key=lambda g: (isinstance(g, str), g))}


def write_report(workdir: pathlib.Path, record: Mapping[str, Any]) -> None:
    """`report.json` (written whole, then renamed: a kill leaves the old file or the new one)
    and `learning_curve.png`."""
    tmp = workdir / (REPORT_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(workdir / REPORT_NAME)
    save_learning_curve(workdir, record)


def finished_report(workdir: pathlib.Path, env: str, steps: int) -> dict[str, Any] | None:
    """The report of a job in `workdir` that already ran its `steps` RL steps on `env`, else None."""
    try:
        record = json.loads((workdir / REPORT_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if record.get("steps") == steps and record.get("env") == env else None


def print_report(record: Mapping[str, Any]) -> dict[str, float]:
    """Prints the before/after table and the last line, `summary: env=... minutes=...`."""
    before, after, shaping = record["before"], record["after"], record["reward_shaping"]
    tasks = len(before["task_success"])
    shaped = f", reward shaping: {shaping}" if shaping else ""  # rewards include it; success never does
    print(f"\n| metric ({tasks} held-out {record['env']} tasks{shaped}) | after SFT | after RL |")
    print("| --- | --- | --- |")
    for key in TABLE_ROWS:
        print(f"| {key} | {before[key]:.3f} | {after[key]:.3f} |")
    print("| success, Wilson 95% | " + " | ".join(f"[{lo:.3f}, {hi:.3f}]" for lo, hi in record["wilson_95"].values()) + " |")
    if by_grade := record.get("success_by_grade"):
        print(f"held-out success by {by_grade['grade']}: " + ", ".join(
            f"{grade}: {wins}/{n} -> {by_grade['after'][grade][0]}/{n}" for grade, (wins, n) in by_grade["before"].items()))
    if sampled := record.get("sampled"):
        (lo0, hi0), (lo1, hi1) = sampled["wilson_95"].values()
        print(f"held-out success sampled at temperature {sampled['temperature']:g}, {sampled['samples']} a task: "
              f"{sampled['success_before']:.3f} [{lo0:.3f}, {hi0:.3f}] -> {sampled['success_after']:.3f} "
              f"[{lo1:.3f}, {hi1:.3f}]; invalid actions {sampled['before']['invalid_action_rate']:.3f} -> "
              f"{sampled['after']['invalid_action_rate']:.3f}")
    if curriculum := record.get("curriculum"):
        print("pass-rate controls: " + ", ".join(
            f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}" for key, value in curriculum.items()))
    if record["resumed_from_step"] is not None:
        print(f"resumed at step {record['resumed_from_step']}: the last process took {record['process_minutes']:.1f} "
              f"of the run's {record['minutes']:.1f} minutes")
    print(summary_line(record))
    return {key: record[key] for key in ("success_before", "success_after", "minutes")}


def summary_line(record: Mapping[str, Any]) -> str:
    """`summary: env=... heldout_tasks=... success_before=... success_after=... minutes=...`
    (and `reward_shaping=...` where the run shaped its rewards)."""
    shaping = record["reward_shaping"]
    return (f"summary: env={record['env']} heldout_tasks={len(record['before']['task_success'])} "
            f"success_before={record['success_before']:.3f} success_after={record['success_after']:.3f} "
            f"minutes={record['minutes']:.1f}" + (f" reward_shaping={shaping}" if shaping else ""))


def learning_curve(records: Sequence[Mapping[str, float]], report: Mapping[str, Any]) -> Figure:
    """Training success per RL step (`records`: metrics.jsonl), the horizon the schedule allowed
    (its own axis, in turns), and held-out success before and after RL with Wilson 95% bars."""
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, [r["success_rate"] for r in records], label="train success (rollout episodes)")
    last = steps[-1] if steps else 1
    for x, phase, label, marker in ((0, "before", "held-out after SFT", "o"), (last, "after", "held-out after RL", "s")):
        rate = report[f"success_{phase}"]
        low, high = report["wilson_95"][phase]
        ax.errorbar([x], [rate], yerr=[[rate - low], [high - rate]], fmt=marker, capsize=4,
                    label=f"{label}: {rate:.3f} (Wilson 95%)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1.05)
    horizon = ax.twinx()
    horizon.step(steps, [r["horizon"] for r in records], where="post", color="gray", linestyle="--", label="horizon")
    horizon.set_ylabel("horizon (turns allowed)")
    horizon.set_ylim(0, max((r["horizon"] for r in records), default=1) * 1.1)
    lines, labels = ax.get_legend_handles_labels()
    more_lines, more_labels = horizon.get_legend_handles_labels()
    ax.legend(lines + more_lines, labels + more_labels, loc="upper left", fontsize="small")
    tasks = len(report["before"]["task_success"])
    ax.set_title(f"RL on {report['env']}: success per step, and on {tasks} held-out tasks")
    fig.tight_layout()
    return fig


def save_learning_curve(workdir: pathlib.Path, report: Mapping[str, Any]) -> None:
    """`learning_curve.png` of the run in `workdir` (nothing when it logged no step)."""
    records = read_metrics(str(workdir / "metrics.jsonl")) if (workdir / "metrics.jsonl").exists() else []
    if not records:
        return
    learning_curve(records, report).savefig(workdir / CURVE_NAME, dpi=100)
