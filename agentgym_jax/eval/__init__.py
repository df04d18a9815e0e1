"""Evaluation runs with honest accounting, reports and plots.

`accounting.py` (which record counts, every rate with its denominator and Wilson interval, pass@k),
`paired.py` (two runs on the same tasks: exact McNemar, paired bootstrap), `report.py` (JSON,
Markdown, PNG plots). Definitions: docs/evaluation.md.
"""
