"""Paired comparison of two evaluation runs on the same task ids (`eval/paired.py`).

    python -m agentgym_jax.eval.compare --a=runs/eval_sft --b=runs/eval_rl [--out=runs/compare]

Each run folder is what `mode=eval` wrote (schedule.json, trajectories.jsonl); both are recounted
with the accounting of docs/evaluation.md, and their per-task end-to-end success rates compared:
exact McNemar (sign) test and a paired bootstrap. Prints a Markdown table; with `--out` also
writes comparison.json and comparison.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from absl import app, flags

from agentgym_jax.eval.accounting import task_success_rates
from agentgym_jax.eval.paired import PairedComparison, compare_runs
from agentgym_jax.eval.report import paired_markdown
from agentgym_jax.eval.runner import load_summary

_A = flags.DEFINE_string("a", None, "first evaluation run folder", required=True)
_B = flags.DEFINE_string("b", None, "second evaluation run folder", required=True)
_OUT = flags.DEFINE_string("out", "", "folder for comparison.json and comparison.md")
_NUM_BOOTSTRAP = flags.DEFINE_integer("num_bootstrap", 10_000, "paired bootstrap resamples")
_SEED = flags.DEFINE_integer("seed", 0, "bootstrap seed")


def compare_dirs(
    a: str | pathlib.Path, b: str | pathlib.Path, num_bootstrap: int = 10_000, seed: int = 0
) -> PairedComparison:
    """Run A against run B, task by task (`ValueError` if their task ids differ)."""
    rates_a = task_success_rates(load_summary(a).episodes)
    rates_b = task_success_rates(load_summary(b).episodes)
    return compare_runs(rates_a, rates_b, num_bootstrap, seed)


def main(argv: list[str]) -> None:
    del argv
    comparison = compare_dirs(_A.value, _B.value, _NUM_BOOTSTRAP.value, _SEED.value)
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
