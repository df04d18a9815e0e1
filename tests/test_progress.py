"""A phase's progress: plain lines in a log (spaced, first and last always), a bar on a terminal,
nothing when off; and the RL job's learning curve as the figure that draws it."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

from agentgym_jax import progress as progress_module
from agentgym_jax.progress import Progress
from agentgym_jax.stats import wilson_interval
from agentgym_jax.train import rl_report


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_at_the_start_every_interval_and_at_the_end():
    log = io.StringIO()
    with Progress("sft", 5, "batch", enabled=True, interval_s=3600, stream=log) as progress:
        for nll in (3.0, 2.0, 1.5, 1.25, 1.125):
            progress.update(nll=nll)
    lines = log.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["sft 0/5 batches", "sft 5/5 batches"]  # the hour never passed
    assert lines[-1].endswith("| nll=1.125") and " s/batch | " in lines[-1] and " elapsed" in lines[-1]


def test_interval_zero_writes_a_line_per_update_with_its_values():
    log = io.StringIO()
    progress = Progress("rl", 3, "step", initial=1, enabled=True, interval_s=0, stream=log)  # resumed after step 1
    progress.set(2, success_rate=0.25, horizon=4.0)
    progress.set(3, success_rate=0.5, horizon=8.0)
    progress.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["rl 1/3 steps", "rl 2/3 steps", "rl 3/3 steps"]
    assert lines[1].endswith("success_rate=0.25 horizon=4") and lines[2].endswith("success_rate=0.5 horizon=8")


def test_retries_raise_the_total():
    log = io.StringIO()
    with Progress("maze", 2, "episode", enabled=True, stream=log) as progress:
        progress.set(2)
        progress.add_total(1)
        progress.set(3)
    assert log.getvalue().splitlines()[-1].startswith("maze 3/3 episodes |")


def test_a_terminal_gets_a_bar_and_a_disabled_progress_writes_nothing():
    terminal = Terminal()
    with Progress("eval", 4, "episode", enabled=True, stream=terminal) as progress:
        progress.set(4, success_rate=0.5)
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue() and "success_rate=0.5" in terminal.getvalue()
    quiet = io.StringIO()
    with Progress("eval", 4, "episode", enabled=False, stream=quiet) as progress:
        progress.set(4)
    assert quiet.getvalue() == ""


def test_a_terminal_without_a_width_gets_lines():
    """A pseudo-terminal opened without a size (some CI runners): tqdm would draw nothing there."""
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as stream:
            assert stream.isatty()
            with Progress("eval", 2, "episode", enabled=True, stream=stream) as progress:
                progress.set(2)
        chunks = []
        while True:  # a pseudo-terminal may hand its lines over one read at a time; EIO once drained
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        out = b"".join(chunks).decode()
    finally:
        os.close(master)
    assert "eval 2/2 episodes | " in out


class Clock:
    """A monotonic clock the test moves (the heartbeat thread reads it too)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module, "time", clock)
    monkeypatch.setattr(progress_module, "TICK_S", 0.01)
    return clock


def wait_for_lines(log: io.StringIO, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while len(log.getvalue().splitlines()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return log.getvalue().splitlines()


def test_a_batch_whose_episodes_finish_together_shows_turns_tokens_and_an_eta(clock):
    """0 of 64 episodes done for minutes is what a batched evaluation looks like: the line says
    how far its turns are, the tokens decoded and the ETA from that share of the work, and the
    heartbeat writes it again every interval while no episode finishes."""
    log = io.StringIO()
    with Progress("eval before RL", 64, "episode", enabled=True, interval_s=10, stream=log) as progress:
        clock.now = 30.0
        progress.set(0, work=0.25, turns=128, tokens=4000)
        clock.now = 45.0  # no update: the heartbeat writes the line again
        lines = wait_for_lines(log, 3)
        clock.now = 60.0
        progress.set(64, work=1.0, turns=400, tokens=9000)
    lines = log.getvalue().splitlines()
    assert lines == [
        "eval before RL 0/64 episodes | 0:00 elapsed",
        "eval before RL 0/64 episodes | 0:30 elapsed | ETA 1:30 | turns=128 tokens=4000",
        "eval before RL 0/64 episodes | 0:45 elapsed | ETA 2:15 | turns=128 tokens=4000",
        "eval before RL 64/64 episodes | 0.938 s/episode | 1:00 elapsed | turns=400 tokens=9000",
    ]
    terminal = Terminal()
    with Progress("eval", 64, "episode", enabled=True, stream=terminal) as progress:
        clock.now = 90.0
        progress.set(0, work=0.25, turns=128)
    assert "ETA=1:30" in terminal.getvalue() and "turns=128" in terminal.getvalue()


def test_a_phase_shown_after_a_while_stays_quiet_when_short(clock):
    """An RL step's rollout shows only once it has run `show_after_s` (then its last line too)."""
    log = io.StringIO()
    with Progress("step 3 rollout", 8, "episode", enabled=True, interval_s=10, show_after_s=10, stream=log) as short:
        clock.now = 5.0
        short.set(8, work=1.0)
    assert log.getvalue() == ""
    clock.now = 100.0
    with Progress("step 4 rollout", 8, "episode", enabled=True, interval_s=10, show_after_s=10, stream=log) as long:
        clock.now = 104.0
        long.set(2, work=0.5, turns=20)
        clock.now = 112.0  # the heartbeat shows it
        assert wait_for_lines(log, 1) == ["step 4 rollout 2/8 episodes | 2 s/episode | 0:12 elapsed | ETA 0:12 | turns=20"]
        clock.now = 120.0
        long.set(8, work=1.0, turns=40)
    assert log.getvalue().splitlines()[-1] == "step 4 rollout 8/8 episodes | 2.67 s/episode | 0:20 elapsed | turns=40"


def test_the_rate_is_the_time_between_counts_whatever_the_heartbeat_writes_between(clock):
    """A batch every 90 s with a line every 10 s in between: each new count's line says 90 s
    a batch (the lines in between move nothing), and the ETA follows from the counts."""
    log = io.StringIO()
    with Progress("sft", 8, "batch", enabled=True, interval_s=10, stream=log) as progress:
        clock.now = 80.0
        progress.set(1)
        for tick in range(90, 170, 10):  # the heartbeat's lines, the count still 1
            clock.now = float(tick)
            wait_for_lines(log, 2 + (tick - 80) // 10)
        clock.now = 170.0
        progress.set(2)
    lines = log.getvalue().splitlines()
    assert lines[1] == "sft 1/8 batches | 80 s/batch | 1:20 elapsed | ETA 9:20"
    assert all(" s/batch" not in line for line in lines[2:-1]), lines
    assert lines[-1] == "sft 2/8 batches | 90 s/batch | 2:50 elapsed | ETA 8:30"


def _report(before: float, after: float, tasks: int = 64) -> dict:
    def result(rate: float) -> dict:
        wins = round(rate * tasks)
        return {"success_rate": wins / tasks, "mean_reward": rate, "turns": 6.0, "invalid_action_rate": 0.0,
                "task_success": [[t, int(t < wins)] for t in range(tasks)]}

    return rl_report.build_report(env="room", seed=0, steps=24, reward_shaping="", before=result(before),
                                  after=result(after), minutes=7.0, process_minutes=7.0, resumed_from_step=None)


def test_the_learning_curve_labels_its_axes_and_marks_held_out_success():
    records = [{"step": s, "success_rate": s / 40, "horizon": (4, 8, 12)[(s - 1) // 8]} for s in range(1, 25)]
    report = _report(0.4375, 0.71875)
    fig = rl_report.learning_curve(records, report)
    ax, horizon_ax = fig.axes
    assert "room" in ax.get_title() and "64 held-out" in ax.get_title()
    assert ax.get_xlabel() == "RL step" and ax.get_ylabel() == "success rate"
    assert horizon_ax.get_ylabel() == "horizon (turns allowed)"
    (horizon_line,) = horizon_ax.get_lines()
    assert set(np.asarray(horizon_line.get_ydata())) == {4, 8, 12}  # in turns, not scaled to the success axis
    (train_line,) = [line for line in ax.get_lines() if line.get_label().startswith("train success")]
    np.testing.assert_allclose(train_line.get_ydata(), [r["success_rate"] for r in records])
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "held-out after SFT: 0.438 (Wilson 95%)" in legend and "held-out after RL: 0.719 (Wilson 95%)" in legend
    # The held-out points sit at RL step 0 and at the last step, with their Wilson intervals as bars.
    for container, phase, step in zip(ax.containers, ("before", "after"), (0, 24)):
        point, _, (bar,) = container.lines
        np.testing.assert_allclose(point.get_xydata(), [[step, report[f"success_{phase}"]]])
        low, high = report["wilson_95"][phase]
        np.testing.assert_allclose(bar.get_segments()[0], [[step, low], [step, high]])


def test_the_report_keeps_the_run_minutes_and_the_last_process_apart(capsys):
    record = _report(0.5, 0.75)
    record.update(minutes=15.7, process_minutes=0.3, resumed_from_step=20)
    assert rl_report.print_report(record)["minutes"] == pytest.approx(15.7)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "resumed at step 20: the last process took 0.3 of the run's 15.7 minutes"
    assert out[-1].endswith("minutes=15.7")


def test_the_report_gives_the_sampled_evaluation_its_own_line_and_intervals(capsys):
    # 4 tasks x 2 samples at temperature 1: 2 of 8 episodes succeed before RL, 6 of 8 after.
    result = lambda wins: {"success_rate": wins / 8, "invalid_action_rate": 0.25 - wins / 32,  # noqa: E731
                           "task_success": [[t, int(2 * t + s < wins)] for t in range(4) for s in range(2)]}
    record = _report(0.5, 0.75)
    record = rl_report.build_report(**{k: record[k] for k in ("env", "seed", "steps", "reward_shaping", "before", "after",
                                                              "minutes", "process_minutes", "resumed_from_step")},
                                    sampled=dict(temperature=1.0, samples=2, before=result(2), after=result(6)))
    sampled = record["sampled"]
    assert (sampled["success_before"], sampled["success_after"]) == (0.25, 0.75)
    assert sampled["wilson_95"]["before"] == pytest.approx(wilson_interval(2, 8))  # over the 8 episodes
    rl_report.print_report(record)
    out = capsys.readouterr().out.strip().splitlines()
    lo0, hi0 = wilson_interval(2, 8)
    lo1, hi1 = wilson_interval(6, 8)
    assert out[-2] == (f"held-out success sampled at temperature 1, 2 a task: 0.250 [{lo0:.3f}, {hi0:.3f}] -> 0.750 "
                       f"[{lo1:.3f}, {hi1:.3f}]; invalid actions 0.188 -> 0.062")
    assert out[-1].startswith("summary: env=room heldout_tasks=64 success_before=0.500")  # the greedy headline


def test_the_report_counts_held_out_success_by_grade_and_names_the_pass_rate_controls(capsys):
    depth = [1, 2, 2, 3, 1, 2]  # one grade per task id
    result = lambda wins: {"success_rate": len(wins) / 6, "mean_reward": 0.0, "turns": 4.0,  # noqa: E731
                           "invalid_action_rate": 0.0, "task_success": [[t, int(t in wins)] for t in range(6)]}
    record = rl_report.build_report(env="textcraft", seed=0, steps=2, reward_shaping="", before=result({0}),
                                    after=result({0, 1, 4}), minutes=1.0, process_minutes=1.0, resumed_from_step=None,
                                    curriculum={"replay": True, "replay_by": "depth"},
                                    grading=rl_report.task_grades({"depth": depth}, "depth"))
    assert record["success_by_grade"] == {"grade": "depth", "before": {"1": [1, 2], "2": [0, 3], "3": [0, 1]},
                                          "after": {"1": [2, 2], "2": [1, 3], "3": [0, 1]}}
    assert rl_report.task_grades({"depth": depth}, "") is None and rl_report.task_grades({}, "depth") is None
    rl_report.print_report(record)
    out = capsys.readouterr().out.strip().splitlines()
    assert "held-out success by depth: 1: 1/2 -> 2/2, 2: 0/3 -> 1/3, 3: 0/1 -> 0/1" in out
    assert "pass-rate controls: replay=True, replay_by=depth" in out
    assert "curriculum" not in _report(0.5, 0.75) and "success_by_grade" not in _report(0.5, 0.75)
