"""Why T3 over the warm-up's 30 steps hurt ``gpt_c64`` at P = 4 (docs/results.md, the ablation:
+9.1% over two seeds, one at +3.6%, the other at +14%): the default and T3 taken apart on the
seed that lost, with each correction off in turn, uncorrected ``async`` with and without T3, and
the switch moved past the rate's warm-up (300 steps, nanoGPT's recipe: the rate peaks at step 30).

    PYTHONPATH=. OMP_NUM_THREADS=1 WANDB_MODE=disabled \
        python -P experiments/results/horizon_t3/why.py --out runs/t3why
    python -P experiments/results/horizon_t3/why.py --out runs/t3why --table

Quality runs only, through the protocol's engine (one process, every stage simulated with the
staleness of one process per stage), at the task's one-device rate 1e-3, N = P = 4.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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


def _table(out: Path, seed: int) -> None:
    runs = {}
    for v in ORDER:
        path = out / "runs" / f"{Job('gpt_c64', v, 4, 4, 1e-3, seed).key}.json"
        if path.exists():
            runs[v] = json.loads(path.read_text())
    print(
        "| run | final validation loss | "
        + " | ".join(f"train loss, steps {a}-{a + 9}" for a in (20, 30, 40, 50, 100, 150, 290))
        + " |"
    )
    print("|---|---|" + "---|" * 7)
    for v, r in runs.items():
        t = r["train_loss"]
        windows = " | ".join(
            f"{sum(t[a : a + 10]) / 10:.3f}" for a in (20, 30, 40, 50, 100, 150, 290)
        )
        print(f"| {v} | {r['metric'][-1]:.3f} | {windows} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/t3why"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="tabulate what is stored")
    args = parser.parse_args()
    grid.VARIANTS.update(RUNS)
    if not args.table:
        jobs = [Job("gpt_c64", v, 4, 4, 1e-3, args.seed) for v in ORDER]
        execute(jobs, args.out, 1, "t3 why")
    _table(args.out, args.seed)


if __name__ == "__main__":
    main()
