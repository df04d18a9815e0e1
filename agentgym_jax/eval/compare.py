"""Paired comparison of two runs on the same task ids (`eval/paired.py`).

    python -m agentgym_jax.eval.compare --a=runs/eval_sft --b=runs/eval_rl [--out=runs/compare]
    python -m agentgym_jax.eval.compare --a=runs/maze_s0,runs/maze_s1,runs/maze_s2 \
        --b=runs/maze_fixed_s0,runs/maze_fixed_s1,runs/maze_fixed_s2      # 3 seeds, pooled
    python -m agentgym_jax.eval.compare --a=runs/maze_s0 --b=runs/maze_s0:before   # RL vs its SFT start

A run folder is one of:
- what `mode=eval` wrote (schedule.json, trajectories.jsonl), recounted with the accounting of
  docs/evaluation.md (end-to-end success per task);
- an RL job's workdir (report.json): its held-out outcomes after RL, or after SFT with `:before`;
  those of its sampled evaluation (`eval.sampled`) with `:sampled_after` and `:sampled_before`
  (a task's success: the share of its samples that succeeded);
- an AgentEvol iteration folder (`<workdir>/iter_<k>`, eval.json).
Comma-separated lists pair position by position (seed with seed) and pool the pairs: a task of
the i-th pair is the key (i, task), so a seed's run is only ever compared with its partner.
Prints a Markdown table: exact McNemar (sign) test and a paired bootstrap; with `--out` also
writes comparison.json and comparison.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Hashable, Sequence

from absl import app, flags

from agentgym_jax.eval.accounting import task_success_rates
from agentgym_jax.eval.paired import PairedComparison, compare_runs
from agentgym_jax.eval.report import paired_markdown
from agentgym_jax.eval.runner import SCHEDULE_NAME, load_summary

_A = flags.DEFINE_string("a", None, "run folder(s) A, comma-separated (module docstring)", required=True)
_B = flags.DEFINE_string("b", None, "run folder(s) B, paired with A's position by position", required=True)
_OUT = flags.DEFINE_string("out", "", "folder for comparison.json and comparison.md")
_NUM_BOOTSTRAP = flags.DEFINE_integer("num_bootstrap", 10_000, "paired bootstrap resamples")
_SEED = flags.DEFINE_integer("seed", 0, "bootstrap seed")


RL_PHASES = ("", "before", "after", "sampled_before", "sampled_after")


def task_rates(run: str | pathlib.Path) -> dict[Hashable, float]:
    """Per-task success of one run folder (module docstring for the kinds, `:before` included)."""
    folder, _, phase = str(run).partition(":")
    folder = pathlib.Path(folder)
    if (folder / "report.json").exists():  # an RL job
        if phase not in RL_PHASES:
            raise ValueError(f"{run}: an RL run is read after RL, or as ':' one of {', '.join(RL_PHASES[1:])}; not {phase!r}")
        report = json.loads((folder / "report.json").read_text())
        if phase.startswith("sampled_"):
            if "sampled" not in report:
                raise ValueError(f"{run}: this run had no sampled evaluation (eval.sampled=0)")
            report = report["sampled"]
        outcomes = report[phase.removeprefix("sampled_") or "after"]["task_success"]
    elif phase:
        raise ValueError(f"{run}: ':{phase}' names a phase of an RL run, and {folder} has no report.json")
    elif (folder / "eval.json").exists():  # an AgentEvol iteration
        outcomes = json.loads((folder / "eval.json").read_text())["eval"]["task_success"]
    elif (folder / SCHEDULE_NAME).exists():
        return task_success_rates(load_summary(folder).episodes)
    else:
        raise ValueError(f"{folder} holds no report.json (RL), eval.json (AgentEvol) or {SCHEDULE_NAME} (eval)")
    wins: dict[Hashable, list[int]] = {}
    for task, success in outcomes:  # one pair per episode: a task's samples average
        wins.setdefault(task, []).append(success)
    return {task: sum(s) / len(s) for task, s in wins.items()}


def compare_dirs(
    a: str | pathlib.Path | Sequence[str | pathlib.Path], b: str | pathlib.Path | Sequence[str | pathlib.Path],
    num_bootstrap: int = 10_000, seed: int = 0,
) -> PairedComparison:
    """Run(s) A against run(s) B, task by task; lists pair position by position (`ValueError` if
    their lengths or a pair's task ids differ)."""
    runs_a, runs_b = _as_list(a), _as_list(b)
    if len(runs_a) != len(runs_b):
        raise ValueError(f"{len(runs_a)} runs A against {len(runs_b)} runs B: pairs need one of each")
    pooled = lambda runs: {(i, k): v for i, run in enumerate(runs) for k, v in task_rates(run).items()}  # noqa: E731
    return compare_runs(pooled(runs_a), pooled(runs_b), num_bootstrap, seed)


def _as_list(runs: str | pathlib.Path | Sequence[str | pathlib.Path]) -> list[str | pathlib.Path]:
    return [runs] if isinstance(runs, (str, pathlib.Path)) else list(runs)


def main(argv: list[str]) -> None:
    del argv
    comparison = compare_dirs(_A.value.split(","), _B.value.split(","), _NUM_BOOTSTRAP.value, _SEED.value)
    markdown = paired_markdown(comparison, name_a=_A.value, name_b=_B.value)
    print(markdown)
    if _OUT.value:
        out = pathlib.Path(_OUT.value)
        out.mkdir(parents=True, exist_ok=True)
        record = {"a": _A.value, "b": _B.value, **dataclasses.asdict(comparison)}
        (out / "comparison.json").write_text(json.dumps(record, indent=2))
        (out / "comparison.md").write_text(markdown)


if __name__ == "__main__":
    app.run(main)
