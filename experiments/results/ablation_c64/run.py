"""What each candidate correction does to the compute-bound GPT at P = 4 and 8 (issue 49,
item 4).

``gpt_c64`` (experiments/studies/protocol.py: 8 blocks of width 128 at context 64, the nanoGPT
recipe) at its one-device rate (``OUT/rates.json``, tuned by ``pipemare user-protocol``) and
the default N = P, each candidate a variant of experiments/studies/grid.py's ``VARIANTS``
(the default with one correction added, changed or taken away). The runs go to the user
protocol's ``OUT/runs`` beside its one-device, default and ``async`` runs, which this reuses::

    pipemare user-protocol --tasks gpt_c64 --seeds 3 --out runs/c64 --phase runs
    python experiments/results/ablation_c64/run.py --out runs/c64 --seeds 0 1

It prints the table: final validation loss, mean ± half-range over the seeds, against one
device's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipemare.experiments.studies.fair import execute
from pipemare.experiments.studies.grid import VARIANTS, Job, load_result

#: the candidates the literature measured, as grid variants
CANDIDATES = (
    "pipemare+EF",  # Zmushko et al.'s error feedback, c = 1
    "pipemare+EFdelay",  # the same, c = the stage's delay
    "pipemare+lookahead2",  # weight prediction twice as far ahead
    "pipemare-noDM",  # without delay-aware momentum
    "pipemare-T1T2",  # PipeMare's T1 + T2 (discrepancy correction instead of prediction)
    "pipemare+T3w30",  # T3: the warm-up's 30 steps synchronous
)

#: the default at twice as many microbatches (N = 2P: every delay halved, no stash)
FINER = "pipemare"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/c64"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="tabulate what is stored")
    args = parser.parse_args()
    rate = json.loads((args.out / "rates.json").read_text())["gpt_c64"]
    jobs = {
        (v, p): [Job("gpt_c64", v, p, p, rate, s) for s in args.seeds]
        for v in ("pipemare", "async", *CANDIDATES)
        for p in args.stages
    }
    finer = {p: [Job("gpt_c64", FINER, p, 2 * p, rate, s) for s in args.seeds] for p in args.stages}
    assert all(v in VARIANTS for v, _ in jobs)
    if not args.table:
        todo = [j for (v, _), js in jobs.items() if v in CANDIDATES for j in js]
        todo += [j for js in finer.values() for j in js]
        execute(todo, args.out, args.workers, "gpt_c64 ablation")
    one = [
        load_result(args.out, Job("gpt_c64", "gpipe", 2, 1, rate, s)).metric[-1] for s in args.seeds
    ]
    ref = statistics.fmean(one)
    print(f"gpt_c64 at rate {rate:g}, N = P, seeds {args.seeds}: final validation loss\n")
    print("| P | corrections | final val loss (mean ± half-range) | vs one device |")
    print("|---|---|---|---|")
    half = (max(one) - min(one)) / 2
    print(f"| 1 | one device (gpipe) | {ref:.4f} ± {half:.4f} | |")
    for (v, p), js in jobs.items():
        finals = [load_result(args.out, j).metric[-1] for j in js]
        mean, half = statistics.fmean(finals), (max(finals) - min(finals)) / 2
        print(f"| {p} | {v} | {mean:.4f} ± {half:.4f} | {100 * (mean / ref - 1):+.2f}% |")
    for p, js in finer.items():
        finals = [load_result(args.out, j).metric[-1] for j in js]
        mean, half = statistics.fmean(finals), (max(finals) - min(finals)) / 2
        gap = 100 * (mean / ref - 1)
        print(f"| {p} | pipemare at N = {2 * p} | {mean:.4f} ± {half:.4f} | {gap:+.2f}% |")


if __name__ == "__main__":
    main()
