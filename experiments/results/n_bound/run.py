"""Issue 61, item 2 ("staleness bounded by N"), the two small tasks: the quality runs.

pipemare (the default variant) at N = P, 2P, 4P (where N divides the batch), uncorrected
``async`` at N = P, and gpipe at P = 2, N = 1 (one device's minibatch; 1F1B's per-step curve
too), each at the task's one-device rate, recipe and length, seeds 0..SEEDS-1. The jobs are the
protocol's own (:class:`~pipemare.experiments.studies.grid.Job`, trained by
:func:`pipemare.experiments.studies.fair.execute` into ``OUT/runs/KEY.json`` with the setup each
resolved; a stored run set up as the job is today is skipped, so the command resumes).

The queue is seed-major (every cell at seed 0, then seed 1, then seed 2), within a seed P by P
(both tasks at P = 4, then both at P = 8), P = 4 and 8 before P = 2, so a queue stopped early
leaves whole tables with fewer seeds.

    PYTHONPATH=. OMP_NUM_THREADS=1 WANDB_MODE=disabled nice -n 19 python \
        experiments/results/n_bound/run.py --stages 4 8 --seeds 3
    ... --stages 2 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipemare.experiments.studies.fair import execute
from pipemare.experiments.studies.grid import Job
from pipemare.experiments.studies.protocol import TASKS

#: task -> (one-device rate, steps): char_gpt@adamw as the main job runs it
#: (experiments/results/main_job/README.md), digits as the user's protocol tuned it
#: (experiments/results/user_protocol/rates.json; the task's own 1,200 steps)
SETUP = {"char_gpt@adamw": (1e-2, 400), "digits": (3e-3, None)}


def cells(task: str, stages: list[int]) -> list[tuple[str, int, int]]:
    """(variant, P, N) of ``task`` at each P: pipemare at N = P, 2P, 4P where N divides the
    batch, async at N = P."""
    batch = TASKS[task].batch
    out = []
    for p in stages:
        out += [("pipemare", p, p), ("async", p, p)]  # the cheapest pair first
        out += [("pipemare", p, n) for n in (2 * p, 4 * p) if batch % n == 0]
    return out


def jobs(stages: list[int], seeds: int, tasks: list[str]) -> list[Job]:
    """Seed-major; within a seed, P by P in the order given, both tasks at each P (gpipe
    first, where the task's seed first comes up)."""
    queue = []
    for seed in range(seeds):
        for i, p in enumerate(stages):
            for task in tasks:
                lr, steps = SETUP[task]
                if i == 0:
                    queue.append(Job(task, "gpipe", 2, 1, lr, seed, steps))
                queue += [Job(task, v, p, n, lr, seed, steps) for v, p, n in cells(task, [p])]
    return queue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=list(SETUP))
    args = parser.parse_args()
    log = args.out / "wall_times.jsonl"
    for job in jobs(args.stages, args.seeds, args.tasks):
        if (args.out / "runs" / f"{job.key}.json").exists():
            continue
        start = time.time()
        execute([job], args.out, 1, job.key)
        with log.open("a") as f:
            f.write(json.dumps({"key": job.key, "wall_s": time.time() - start}) + "\n")


if __name__ == "__main__":
    main()
