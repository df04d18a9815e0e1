"""Evaluation reports: JSON, a Markdown table and PNG plots of an `EvalSummary`.

Plots (matplotlib, Agg backend, no display needed):
- `success_by_env.png`: end-to-end success per environment with Wilson 95% intervals, and the
  conditional success over scored episodes next to it (labelled).
- `success_vs_turns.png`: per environment, the share of scheduled episodes that succeeded within
  t turns, for every t (what a turn limit of t would have allowed).
"""

from __future__ import annotations

import dataclasses
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from agentgym_jax.eval.accounting import CountedEpisode, EvalSummary, Metrics, Rate  # noqa: E402
from agentgym_jax.eval.paired import PairedComparison  # noqa: E402

JSON_NAME = "summary.json"
MARKDOWN_NAME = "summary.md"
BARS_NAME = "success_by_env.png"
TURNS_NAME = "success_vs_turns.png"


def percent(rate: Rate) -> str:
    """`value [low, high] (k/n)` in percent, Wilson 95%."""
    if rate.value is None:
        return "—"
    return f"{100 * rate.value:.1f}% [{100 * rate.low:.1f}, {100 * rate.high:.1f}] ({rate.numerator}/{rate.denominator})"


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown_table(summary: EvalSummary) -> str:
    """One row per environment plus `overall`; every rate shows its Wilson 95% interval and n."""
    ks = sorted(summary.overall.pass_at_k)
    header = (
        ["env", "scheduled", "success (end-to-end)", "conditional success (scored only)", "infra rate", "mean score"]
        + [f"pass@{k}" for k in ks]
        + [f"pass^{k}" for k in ks if k > 1]  # pass^1 is pass@1
        + [f"avg@{summary.overall.group_size}", "invalid-action rate", "mean turns", "retries", "statuses"]
    )
    rows = [*summary.per_env.items(), ("overall", summary.overall)]

    def row(name: str, m: Metrics) -> list[str]:
        statuses = ", ".join(f"{s} {n}" for s, n in m.status_counts.items() if n)
        return (
            [name, str(m.scheduled), percent(m.success), percent(m.conditional_success), percent(m.infra_rate)]
            + [_num(m.mean_score)]
            + [_num(m.pass_at_k.get(k)) for k in ks]
            + [_num(m.pass_hat_k.get(k)) for k in ks if k > 1]
            + [_num(m.avg_at_k), _num(m.invalid_action_rate), _num(m.mean_turns, 2), str(m.retries), statuses]
        )

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(name, m)) + " |" for name, m in rows]
    notes = (
        "End-to-end success counts infrastructure errors, environment timeouts and missing episodes "
        "as failures (denominator: scheduled = tasks x samples). Conditional success is over scored "
        "episodes only. Intervals: Wilson 95%. Mean score: end-to-end, on the environment's own scale."
    )
    mismatches = summary.overall.status_mismatches
    if mismatches:
        notes += (
            f"\n\n**Warning:** {mismatches} scored episode(s) have a status that disagrees with the "
            "success threshold (success is decided by the threshold)."
        )
    return "\n".join(lines) + "\n\n" + notes + "\n"


def paired_markdown(comparison: PairedComparison, name_a: str = "A", name_b: str = "B") -> str:
    """A short Markdown table of a paired comparison."""
    c = comparison
    return (
        f"| tasks | {name_a} | {name_b} | difference [95% bootstrap] | wins/losses/ties | McNemar exact p | bootstrap p |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {c.num_tasks} | {c.mean_a:.3f} | {c.mean_b:.3f} | {c.mean_difference:+.3f} "
        f"[{c.bootstrap_ci[0]:+.3f}, {c.bootstrap_ci[1]:+.3f}] | {c.wins}/{c.losses}/{c.ties} | "
        f"{c.mcnemar_p:.4g} | {c.bootstrap_p:.4g} (n={c.num_bootstrap}, seed={c.seed}) |\n"
    )


def plot_success_by_env(summary: EvalSummary, path: str) -> None:
    names = [*summary.per_env, "overall"]
    metrics = [*summary.per_env.values(), summary.overall]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(names)), 3.5))
    width = 0.38
    for offset, label, pick in (
        (-width / 2, "end-to-end", lambda m: m.success),
        (width / 2, "conditional (scored only)", lambda m: m.conditional_success),
    ):
        rates = [pick(m) for m in metrics]
        values = [r.value or 0.0 for r in rates]
        errors = [
            [(r.value - r.low) if r.value is not None else 0.0 for r in rates],
            [(r.high - r.value) if r.value is not None else 0.0 for r in rates],
        ]
        ax.bar([i + offset for i in range(len(names))], values, width, yerr=errors, capsize=3, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.25)  # room for the legend above the bars
    ax.set_ylabel("success rate (Wilson 95%)")
    ax.legend(fontsize="small", loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def success_within_turns(episodes: list[CountedEpisode]) -> tuple[list[int], list[float]]:
    """Turn counts t = 0..max and the share of `episodes` that succeeded within t turns."""
    success_turns = [e.record.num_turns for e in episodes if e.success]
    max_turns = max((e.record.num_turns for e in episodes if e.record is not None), default=0)
    ts = list(range(max_turns + 1))
    n = max(len(episodes), 1)
    return ts, [sum(t_s <= t for t_s in success_turns) / n for t in ts]


def plot_success_vs_turns(summary: EvalSummary, path: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for env in summary.per_env:
        ts, shares = success_within_turns([e for e in summary.episodes if e.env == env])
        ax.step(ts, shares, where="post", label=env)
    ax.set_xlabel("turns")
    ax.set_ylabel("success within t turns (end-to-end)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    summary: EvalSummary, out_dir: str, comparison: PairedComparison | None = None
) -> dict[str, str]:
    """Writes summary.json, summary.md and the two PNGs to `out_dir`; returns name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in (JSON_NAME, MARKDOWN_NAME, BARS_NAME, TURNS_NAME)}
    record = summary.to_json()
    markdown = markdown_table(summary)
    if comparison is not None:
        record["paired_comparison"] = dataclasses.asdict(comparison)
        markdown += "\n## Paired comparison\n\n" + paired_markdown(comparison)
    with open(paths[JSON_NAME], "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    with open(paths[MARKDOWN_NAME], "w", encoding="utf-8") as f:
        f.write(markdown)
    plot_success_by_env(summary, paths[BARS_NAME])
    plot_success_vs_turns(summary, paths[TURNS_NAME])
    return paths
