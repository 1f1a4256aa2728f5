"""The dispatch-bound GPT at twice its length: does N = P's gap at 400 steps last?

At 400 steps (``run.py``) pipemare at N = P never came within 1% of one device on
``char_gpt@adamw`` at P = 4 and 8 (+1.1%, +1.8%), which is what makes issue 61's rule pick
N = 2P on dispatch-bound stages. The user's protocol ran the same task for 800 steps at N = P
and found it within 1% (experiments/results/user_protocol). This runs both N at 800 steps,
same rate, same seeds, on the protocol's engine: gpipe (one device), pipemare at N = P and 2P,
at P = 4 and 8, seeds 0..SEEDS-1, seed-major. ``--worker i --workers k`` runs every k-th job.

    PYTHONPATH=$CODE OMP_NUM_THREADS=1 WANDB_MODE=disabled nice -n 19 python -P \
        experiments/results/n_bound/long_runs.py --out experiments/results/n_bound/long --worker 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipemare.experiments.studies.fair import execute
from pipemare.experiments.studies.grid import Job

TASK, LR, STEPS = "char_gpt@adamw", 1e-2, 800


def long_jobs(stages: list[int], seeds: int) -> list[Job]:
    """Seed-major: one device, then pipemare at N = P and 2P at each P."""
    queue = []
    for seed in range(seeds):
        queue.append(Job(TASK, "gpipe", 2, 1, LR, seed, STEPS))
        for p in stages:
            queue += [Job(TASK, "pipemare", p, n, LR, seed, STEPS) for n in (p, 2 * p)]
    return queue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "long")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "wall_times.jsonl"
    for i, job in enumerate(long_jobs(args.stages, args.seeds)):
        if i % args.workers != args.worker or (args.out / "runs" / f"{job.key}.json").exists():
            continue
        start = time.time()
        execute([job], args.out, 1, job.key)
        with log.open("a") as f:
            f.write(json.dumps({"key": job.key, "wall_s": time.time() - start}) + "\n")


if __name__ == "__main__":
    main()
