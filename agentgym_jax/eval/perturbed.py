"""Clean-versus-perturbed evaluation (AgentGym2): the same tasks played against clean servers and
against servers wrapped by perturbations (`--perturbation`, `environments/perturbation.py`), and
the gap per setting.

    python -m agentgym_jax.launch --config=configs/eval.py --config.envs=weather \
        --config.perturbations="noise=0.05;tool_failure=0.2,schema_change=3"

`perturbations` lists settings separated by `;` (each one server flag's value). Each setting is
an evaluation of its own into `out_dir/<setting>/` (`clean` first), on local servers started
with that perturbation, which must name it back in their `/tasks` metadata (a server that
ignored the flag would report clean results as perturbed ones). `perturbation_gap.md` and
`.json` then give per setting end-to-end success (Wilson 95%), pass@1 and pass^k, and the gap to
clean paired task by task (`eval/paired.py`): clean minus perturbed success, its 95% bootstrap
interval, wins/losses/ties and the exact McNemar p.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.eval.accounting import EvalSummary, task_success_rates
from agentgym_jax.eval.paired import compare_runs
from agentgym_jax.eval.report import percent

CLEAN = ""
JSON_NAME, MARKDOWN_NAME = "perturbation_gap.json", "perturbation_gap.md"


def settings(spec: str) -> list[str]:
    """`"noise=0.05;truncate=400"` -> ["", "noise=0.05", "truncate=400"] (clean first)."""
    perturbed = [s.strip() for s in spec.split(";") if s.strip()]
    if len(set(perturbed)) != len(perturbed):
        raise ConfigError(f"perturbations lists a setting twice: {spec!r}")
    return [CLEAN, *perturbed]


def folder(setting: str) -> str:
    """`"noise=0.05,truncate=400"` -> "noise-0.05_truncate-400"; the clean setting is "clean"."""
    return setting.replace("=", "-").replace(",", "_") if setting else "clean"


def _values(spec: str) -> dict[str, float]:
    pairs = (part.partition("=") for part in spec.split(",") if part.strip())
    try:
        return {key.strip(): float(value) for key, _, value in pairs if float(value)}
    except ValueError:
        raise ConfigError(f"perturbation {spec!r}: expected key=number pairs such as noise=0.05,truncate=400") from None


def check_confirmed(info: TaskInfo, setting: str) -> None:
    """The server's `/tasks` names the perturbation it was started with (none for clean)."""
    served = info.metadata.get("perturbation", "")
    if _values(served) != _values(setting):
        raise ConfigError(f"{info.env}'s server reports perturbation {served!r}, not {setting!r}; "
                          "it ignored --perturbation or was started otherwise")


def gap_report(summaries: Mapping[str, EvalSummary], out_dir: pathlib.Path, num_bootstrap: int = 10_000,
               seed: int = 0) -> tuple[dict, str]:
    """Per setting its rates and the paired gap to clean; writes both files to `out_dir`."""
    clean = summaries[CLEAN]
    clean_rates = task_success_rates(clean.episodes)
    k = clean.overall.group_size
    rows, lines = [], [
        f"| setting | success (end-to-end) | pass@1 | pass^{k} | gap to clean [95% bootstrap] | wins/losses/ties | McNemar p |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, summary in summaries.items():
        o = summary.overall
        row = {"setting": setting or "clean", "folder": folder(setting), "success": dataclasses.asdict(o.success),
               "pass_at_1": o.pass_at_k.get(1), f"pass_hat_{k}": o.pass_hat_k.get(k)}
        gap = "—", "—", "—"
        if setting != CLEAN:
            c = compare_runs(clean_rates, task_success_rates(summary.episodes), num_bootstrap, seed)
            row["gap"] = dataclasses.asdict(c)
            gap = (f"{c.mean_difference:+.3f} [{c.bootstrap_ci[0]:+.3f}, {c.bootstrap_ci[1]:+.3f}]",
                   f"{c.wins}/{c.losses}/{c.ties}", f"{c.mcnemar_p:.4g}")
        rows.append(row)
        lines.append(f"| {row['setting']} | {percent(o.success)} | {o.pass_at_k.get(1, 0):.3f} | {o.pass_hat_k.get(k, 0):.3f} | "
                     + " | ".join(gap) + " |")
    markdown = "\n".join(lines) + (
        "\n\nThe gap is clean minus perturbed success, per task and paired (wins: tasks clean solved more often), "
        f"over {len(clean_rates)} tasks x {k} samples; pass^{k}: all {k} samples of a task succeed.\n")
    record = {"settings": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_NAME).write_text(json.dumps(record, indent=2))
    (out_dir / MARKDOWN_NAME).write_text(markdown)
    return record, markdown


def summary_line(record: dict, envs: Sequence[str], out_dir: pathlib.Path) -> str:
    """`summary: envs=... settings=... clean_success=... largest_gap=... out_dir=...`."""
    rows = record["settings"]
    largest = max((r["gap"]["mean_difference"] for r in rows if "gap" in r), default=0.0)
    return (f"summary: envs={','.join(envs)} settings={len(rows)} clean_success={rows[0]['success']['value']:.3f} "
            f"largest_gap={largest:+.3f} out_dir={out_dir}")
