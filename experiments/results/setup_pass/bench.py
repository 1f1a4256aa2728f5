"""Setup's timing of one microbatch, the three calls apart (as before 2026-12-02's change)
against :func:`pipemare.model.partition.time_layers` (one forward through the layers for all
three), on a protocol task's model at each N of the batch, taken in turn. Run alone:

    OMP_NUM_THREADS=1 python experiments/results/setup_pass/bench.py gpt_c64s --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from experiments.studies.protocol import TASKS, _timed_model
from pipemare.model import partition


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = TASKS[args.task]
    model = _timed_model(task.name)
    x, y, _, _ = task.data()
    x, y = x[: task.batch], y[: task.batch]
    sizes = [n for n in (1, 2, 4, 8, 16) if task.batch % n == 0]

    def head(out, target):
        return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())

    def apart() -> None:
        for n in sizes:
            rows = task.batch // n
            xs, ys = x[:rows], y[:rows]
            partition.layer_passes(model, xs)
            partition.layer_out_bytes(model, xs)
            partition.head_passes(lambda out, ys=ys: head(out, ys), model, xs)

    def together() -> None:
        for n in sizes:
            rows = task.batch // n
            xs, ys = x[:rows], y[:rows]
            partition.time_layers(model, xs, head=lambda out, ys=ys: head(out, ys))

    seconds: dict[str, list[float]] = {"apart": [], "together": []}
    for _ in range(args.rounds):
        for name, call in (("apart", apart), ("together", together)):
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "task": task.name,
        "sizes": sizes,
        "seconds": seconds,
        "median_s": medians,
        "together_over_apart": medians["together"] / medians["apart"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
