"""Seconds per row of each task's whole model, forward and backward, one thread, at every
microbatch size N = 1, 2, 4, ..., batch runs: the method of
:func:`pipemare.experiments.studies.user_protocol.measure_cost_per_row` (the model at seed 0,
the median of REPEATS calls after one warm-up), at every N rather than the default N alone.
Each size also keeps the median of the calls' CPU time (``cpu``, this thread's
``time.thread_time``): on a shared machine the wall-clock median measures the contention (the
process waits for a core), CPU time counts only the time the thread ran; alone, the two agree
and the wall-clock median is the tool's figure.

The cap of issue 61: N stops being admissible where a row costs more than 1.25x what a row of
the whole batch (N = 1) costs.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 19 python experiments/results/n_bound/cost_per_row.py \
        --sitting 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pipemare.experiments.studies.protocol import TASKS


def _measure(name: str, repeats: int) -> dict[str, dict[str, float]]:
    task = TASKS[name]
    torch.manual_seed(0)
    model = task.build()
    x, y, _, _ = task.data()
    sizes = [task.batch // n for n in range(1, task.batch + 1) if task.batch % n == 0]
    per: dict[str, dict[str, float]] = {}
    for rows in sorted(sizes, reverse=True):
        seconds, cpu = [], []
        for _ in range(repeats + 1):
            start, start_cpu = time.perf_counter(), time.thread_time()
            task.loss(model(x[:rows]), y[:rows]).backward()
            seconds.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        per[str(rows)] = {
            "median": statistics.median(seconds[1:]) / rows,
            "cpu": statistics.median(cpu[1:]) / rows,
        }
    return per


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--tasks", nargs="+", default=["char_gpt@adamw", "digits"])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--sitting", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.out / f"cost_per_row-{args.sitting}.json"
    costs = {name: _measure(name, args.repeats) for name in args.tasks}
    path.write_text(json.dumps(costs, indent=1, sort_keys=True) + "\n")
    for name, per in costs.items():
        for how in ("median", "cpu"):
            whole = per[str(TASKS[name].batch)][how]
            shown = {r: f"{1000 * s[how]:.3f} ms ({s[how] / whole:.2f}x)" for r, s in per.items()}
            print(name, how, shown)


if __name__ == "__main__":
    main()
