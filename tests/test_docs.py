"""The docs a clone holds say what the code does: the pages they send readers to exist, and the
`summary:` lines they show name the fields the jobs print."""

from __future__ import annotations

import pathlib
import re

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.eval.accounting import EpisodeRecord, summarize
from agentgym_jax.eval.runner import summary_line as eval_summary_line
from agentgym_jax.train import rl_report

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "configs").glob("*.py")), REPO / "launch" / "README.md", REPO / "bench" / "README.md"]


def _text(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8")


def test_every_page_a_doc_names_is_in_the_repository():
    """A `.md` path in backticks or a link resolves from the repository root or from the doc's
    folder (`summary.md` is what an evaluation writes, not a page)."""
    missing = []
    for doc in DOCS:
        for name in re.findall(r"[`(]([\w./-]+\.md)[`)#]", _text(doc)):
            if name != "summary.md" and not ((REPO / name).exists() or (doc.parent / name).exists()):
                missing.append(f"{doc.relative_to(REPO)}: {name}")
    assert not missing, missing


def _documented_summaries(prefix: str) -> list[tuple[str, list[str]]]:
    """(where, keys) of every `summary: <prefix>...` a doc shows in backticks (a span may wrap lines)."""
    found = []
    for doc in DOCS:
        for span in re.findall(r"`(summary: [^`]*)`", _text(doc)):
            if span.startswith(f"summary: {prefix}"):
                found.append((str(doc.relative_to(REPO)), re.findall(r"(\w+)=", span)))
    return found


def _keys(line: str) -> list[str]:
    return re.findall(r"(\w+)=", line)


def test_documented_rl_summary_lines_name_the_printed_fields():
    result = {"success_rate": 0.5, "task_success": [[0, 1], [1, 0]]}
    record = rl_report.build_report(env="room", seed=0, steps=2, reward_shaping="", before=result, after=result,
                                    minutes=1.0, process_minutes=1.0, resumed_from_step=None)
    printed = _keys(rl_report.summary_line(record))
    documented = _documented_summaries("env=")
    assert len(documented) >= 3  # README, docs/quickstart.md, configs/quickstart.py
    for where, keys in documented:
        assert keys == printed, (where, keys, printed)


def test_documented_eval_summary_lines_name_the_printed_fields(tmp_path):
    records = [EpisodeRecord("maze", 0, 0, 0, 1.0, EpisodeStatus.SUCCESS, 3, 0)]
    printed = _keys(eval_summary_line(summarize(records, {"maze": 1.0}, group_size=1), ["maze"], tmp_path))
    documented = _documented_summaries("envs=... scheduled")
    assert len(documented) >= 2  # docs/evaluation.md, configs/eval.py
    for where, keys in documented:
        assert keys == printed, (where, keys, printed)
