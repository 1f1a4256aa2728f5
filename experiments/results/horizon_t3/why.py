"""Why T3 over the warm-up's 30 steps hurt ``gpt_c64`` at P = 4 (docs/results.md, the ablation:
+9.1% over two seeds, one at +3.6%, the other at +14%): the default and T3 taken apart on the
seed that lost, with each correction off in turn, uncorrected ``async`` with and without T3, and
the switch moved past the rate's warm-up (300 steps, nanoGPT's recipe: the rate peaks at step 30).

    PYTHONPATH=. OMP_NUM_THREADS=1 WANDB_MODE=disabled \
        python -P experiments/results/horizon_t3/why.py --out runs/t3why --seeds 1
    PYTHONPATH=. OMP_NUM_THREADS=1 WANDB_MODE=disabled \
        python -P experiments/results/horizon_t3/why.py --out runs/t3why --seeds 2 3 \
        --only pipemare pipemare+T3w30 pipemare+T3w30-noWP pipemare+T3w60
    python -P experiments/results/horizon_t3/why.py --out runs/t3why --seeds 1 2 3 --table

Quality runs only, through the protocol's engine (one process, every stage simulated with the
staleness of one process per stage), at the task's one-device rate 1e-3, N = P = 4.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from pipemare.experiments.studies import grid
from pipemare.experiments.studies.fair import execute
from pipemare.experiments.studies.grid import Job
from pipemare.optim import PipeMareConfig

#: the runs taken apart: variant -> (schedule, config), added to the grid's variants
RUNS = {
    "async+T3w30": ("async", dataclasses.replace(PipeMareConfig.off(), warmup_steps=30)),
    "pipemare+T3w30-noT1": ("pipemare", PipeMareConfig(warmup_steps=30, lr_reschedule=False)),
    "pipemare+T3w30-noguard": (
        "pipemare",
        PipeMareConfig(warmup_steps=30, stability_guard=False),
    ),
    "pipemare+T3w30-noWP": ("pipemare", PipeMareConfig(warmup_steps=30, weight_prediction=False)),
    "pipemare+T3w30-noSC": (
        "pipemare",
        PipeMareConfig(warmup_steps=30, spike_compensation=False),
    ),
    "pipemare+T3w60": ("pipemare", PipeMareConfig(warmup_steps=60)),
}
ORDER = ("pipemare", "pipemare+T3w30", *RUNS, "async")
#: the training-loss windows shown (first steps of ten)
WINDOWS = (20, 30, 40, 50, 100, 150, 290)


def _table(out: Path, seeds: list[int]) -> None:
    """Final validation loss per run and seed, and the mean training loss over windows of ten
    steps around the switch (the first seed's)."""
    print("| run | final validation loss per seed | mean | " + " | ".join(
        f"train loss, steps {a}-{a + 9}" for a in WINDOWS) + " |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(WINDOWS))
    for v in ORDER:
        runs = {}
        for seed in seeds:
            path = out / "runs" / f"{Job('gpt_c64', v, 4, 4, 1e-3, seed).key}.json"
            if path.exists():
                runs[seed] = json.loads(path.read_text())
        if not runs:
            continue
        finals = ", ".join(f"{r['metric'][-1]:.3f} (s{k})" for k, r in runs.items())
        mean = statistics.fmean(r["metric"][-1] for r in runs.values())
        t = next(iter(runs.values()))["train_loss"]
        windows = " | ".join(f"{sum(t[a : a + 10]) / 10:.3f}" for a in WINDOWS)
        print(f"| {v} | {finals} | {mean:.3f} | {windows} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/t3why"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--only", nargs="+", choices=ORDER, help="these runs (default: all)")
    parser.add_argument("--table", action="store_true", help="tabulate what is stored")
    args = parser.parse_args()
    grid.VARIANTS.update(RUNS)
    if not args.table:
        variants = args.only or ORDER
        jobs = [Job("gpt_c64", v, 4, 4, 1e-3, s) for s in args.seeds for v in variants]
        execute(jobs, args.out, 1, "t3 why")
    _table(args.out, args.seeds)


if __name__ == "__main__":
    main()
