"""The dashboard: runs read from their directories, their figures and tables, one HTML page."""

from pipemare.experiments.dashboard.page import default_out, main, write_dashboard
from pipemare.experiments.dashboard.runs import Run, find_runs
from pipemare.experiments.dashboard.tables import answer, gap, ranked, results_table

__all__ = [
    "Run",
    "answer",
    "default_out",
    "find_runs",
    "gap",
    "main",
    "ranked",
    "results_table",
    "write_dashboard",
]
