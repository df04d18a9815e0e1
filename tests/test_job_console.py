"""What a user sees of a job: progress lines for every phase in a log, a finished job re-run
without rewriting its results, and an evaluation whose output holds no warning about how it was
started. Run through the launcher as a user runs it, on a machine without PyTorch."""

from __future__ import annotations

import glob
import json
import re

import pytest

from tests.rl_runs import SUMMARY, TINY_RL_JOB, launch

STEPS = 2
# What should never reach a user's console: JAX's warning about fork() after its threads started,
# orbax reading a checkpoint item as if it were a step, transformers advising about PyTorch.
UNWANTED = ("os.fork()", "_CHECKPOINT_METADATA", "PyTorch was not found", "Traceback")


def _tiny_run(workdir) -> tuple[dict, object]:
    """A 2-step RL job (stderr is a pipe, so progress comes as plain lines): its overrides and output."""
    overrides = {**TINY_RL_JOB, "workdir": workdir, "train.steps": STEPS, "train.checkpoint_every": STEPS,
                 "horizon_schedule.steps_per_stage": 1}
    done = launch("configs/quickstart.py", overrides, timeout=600, without_torch=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return overrides, done


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three launches, each with its own time-out
def test_a_tiny_job_as_its_user_sees_it(tmp_path):
    """One job (its launches are the cost), three checks: the progress of every phase, a re-run of
    the finished job, and no warning in its output or in an evaluation of its checkpoint."""
    workdir = tmp_path / "rl"
    overrides, done = _tiny_run(workdir)
    _check_every_phase_shows_its_progress_as_plain_lines(done)
    _check_the_viewer_numbers_steps_as_metrics_jsonl(workdir)
    _check_a_finished_job_run_again_prints_its_report_and_changes_nothing(workdir, overrides, done)
    _check_outputs_hold_no_warning_about_how_the_job_started(workdir, done, tmp_path / "eval")


def _progress_lines(stderr: str, phase: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{phase} ")]


def _check_every_phase_shows_its_progress_as_plain_lines(done) -> None:
    assert "\r" not in done.stderr  # no bar redrawn in a log
    counts = {  # phase -> the count its last line shows
        "demonstrations": "4/4 episodes", "sft": "2/2 batches", "eval before RL": "2/2 episodes",
        "rl": f"{STEPS}/{STEPS} steps", "eval after RL": "2/2 episodes",
    }
    for phase, count in counts.items():
        lines = _progress_lines(done.stderr, phase)
        assert lines and lines[0].startswith(f"{phase} 0/"), (phase, done.stderr[-3000:])  # a line as it starts
        assert lines[-1].startswith(f"{phase} {count} | "), (phase, lines)
    step_lines = _progress_lines(done.stderr, "rl")[1:]
    assert len(step_lines) == STEPS  # one line per RL step
    for step, line in enumerate(step_lines, start=1):
        match = re.fullmatch(rf"rl {step}/{STEPS} steps \| ([\d.]+) s/step \| \d+:\d\d elapsed (\| ETA \d+:\d\d )?"
                             r"\| success_rate=(\S+) horizon=(\d+) .*", line)
        assert match, line
        assert float(match[1]) > 0 and 0 <= float(match[3]) <= 1 and int(match[4]) == step  # horizon (1, 2)
        assert (match[2] is not None) == (step < STEPS)  # the ETA, until the last step
    assert "nll=" in _progress_lines(done.stderr, "sft")[-1]
    order = [next(i for i, line in enumerate(done.stderr.splitlines()) if line.startswith(f"{phase} "))
             for phase in counts]
    assert order == sorted(order)  # the phases in the order the job runs them


def _check_the_viewer_numbers_steps_as_metrics_jsonl(workdir) -> None:
    """The viewer's step N is metrics.jsonl's step N: the episodes it lists under step N are the
    ones whose success rate metrics.jsonl logged for step N."""
    from agentgym_jax.view.index import Filter, RunIndex, run_files

    index = RunIndex("rl", run_files(workdir))
    counts = index.step_counts(index.select(Filter()))
    metrics = {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}
    assert counts["steps"] == sorted(metrics) == list(range(1, STEPS + 1))
    for step, episodes, success in zip(counts["steps"], counts["episodes"], counts["success"]):
        assert success / episodes == pytest.approx(metrics[step]["success_rate"]), step


def _check_a_finished_job_run_again_prints_its_report_and_changes_nothing(workdir, overrides, first) -> None:
    report = (workdir / "report.json").read_text()
    events = sorted(glob.glob(str(workdir / "tensorboard" / "events.*")))
    again = launch("configs/quickstart.py", overrides, timeout=300, without_torch=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == first.stdout.strip().splitlines()[-1]  # the same minutes too
    assert "finished (2 steps" in again.stdout
    assert (workdir / "report.json").read_text() == report
    assert sorted(glob.glob(str(workdir / "tensorboard" / "events.*"))) == events
    record = json.loads(report)
    assert record["resumed_from_step"] is None and record["minutes"] == record["process_minutes"] > 0
    summary = SUMMARY.match(first.stdout.strip().splitlines()[-1])
    assert float(summary[5]) == pytest.approx(record["minutes"], abs=0.05)


def _check_outputs_hold_no_warning_about_how_the_job_started(workdir, rl, out_dir) -> None:
    """The RL job, and an evaluation of its checkpoint (whose servers start after JAX has)."""
    done = launch("configs/eval.py", {"envs": "room", "policy": f"checkpoint:{workdir}", "task_ids": 2, "horizon": 2,
                                      "out_dir": out_dir}, timeout=300, without_torch=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for output in (rl.stderr, done.stderr):
        assert not [w for w in UNWANTED if w in output], output[-3000:]
    assert _progress_lines(done.stderr, "room")[-1].startswith("room 2/2 episodes")
