"""Can the regime be told at setup? What a row of half the batch costs over a row of the whole
batch, timed as the first batch times the layers (:func:`pipemare.model.partition.layer_passes`:
every layer's forward and backward, this thread's CPU time), one round of each size in turn,
the median of seven such ratios. Over 1.25 (issue 61's line) a task is dispatch-bound.

This measured a rule that was built and not adopted (N = 2P on dispatch-bound stages; see the
README here): the default N stays P. It shows how far apart the two regimes sit on the
protocol's tasks when measured this way.

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/n_bound/setup_regime.py --sitting 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from pipemare.experiments.studies.protocol import TASKS
from pipemare.model import partition

#: issue 61's line: a row costing more than this times a row of the whole batch
LINE = 1.25

DEFAULT = ["gpt_c64s", "gpt_c64s_halves", "gpt_c64", "char_gpt", "char_lm", "digits", "mnist"]


def half_batch_cost(name: str, rounds: int = 7) -> float:
    """The task's row cost at half its batch, at seed 0: the median over ``rounds`` of one
    round of the whole batch and one of its half, taken in turn."""
    task = TASKS[name]
    torch.manual_seed(0)
    model = task.build()
    x, _, _, _ = task.data()
    rows, half = task.batch, -(-task.batch // 2)
    ratios = []
    for _ in range(rounds):
        whole = sum(f + b for f, b in partition.layer_passes(model, x[:rows], repeats=1))
        part = sum(f + b for f, b in partition.layer_passes(model, x[:half], repeats=1))
        ratios.append((part / half) / (whole / rows))
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--tasks", nargs="+", default=DEFAULT)
    parser.add_argument("--sitting", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    costs = {name: half_batch_cost(name) for name in args.tasks}
    path = args.out / f"setup_regime-{args.sitting}.json"
    path.write_text(json.dumps(costs, indent=1, sort_keys=True) + "\n")
    for name, cost in costs.items():
        regime = "dispatch-bound" if cost > LINE else "compute-bound"
        print(f"{name}: a row of half the batch costs {cost:.2f}x the whole's ({regime})")


if __name__ == "__main__":
    main()
