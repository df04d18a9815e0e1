"""Evaluation runs with honest accounting, reports and plots."""
