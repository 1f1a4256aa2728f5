"""``pipemare compare RUN_DIR...``: one self-contained HTML page (and PNGs) comparing runs.

It finds every run (a directory with ``summary.json``) under the given directories and shows,
per task: the runs ranked by their best monitored value with each one's gap to gpipe, the
monitored metric and the training loss against steps and against pipeline time (what P
devices take; replayed from measured action times for stages simulated in one process, whose
own serial wall time is shown apart and labelled as such), the delays per stage (derived and
measured), utilisation per stage, and memory (weights, optimiser state, PipeDream's stash,
correction buffers, activations held).
"""

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
