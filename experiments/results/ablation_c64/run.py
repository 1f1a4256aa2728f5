"""What each candidate correction does to the compute-bound GPT at P = 4 (issue 49, item 4).

``gpt_c64`` (experiments/studies/protocol.py: 8 blocks of width 128 at context 64, the nanoGPT
recipe) at its one-device rate (``runs/c64/rates.json``, tuned by ``pipemare user-protocol``),
P = 4 at the default N = 4, every candidate added to the default corrections; one-device runs
and the default's come from the user's protocol's runs (``runs/c64/runs``). Each run's final
validation loss goes to ``OUT/NAME-sSEED.json``; ``--table`` prints the table::

    python experiments/results/ablation_c64/run.py --seeds 0 1 --workers 2
    python experiments/results/ablation_c64/run.py --seeds 0 1 --table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from multiprocessing import get_context
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: candidate -> the PipeMareConfig fields it changes (the rest are the default's)
CANDIDATES: dict[str, dict] = {
    "error feedback c=1 (Zmushko et al.)": {"error_feedback": 1.0},
    "error feedback c=delay": {"error_feedback": "delay"},
    "look-ahead x2 (prediction_scale=2)": {"prediction_scale": 2.0},
    "no delay-aware momentum": {"delay_momentum": None},
    "T2 instead of prediction": {"discrepancy_correction": True},
}
STAGES, MICROBATCHES = 4, 4


def _train(args: tuple[str, int, float, Path]) -> None:
    import torch

    from pipemare import PipeMareConfig
    from pipemare.experiments.studies.protocol import TASKS, run_task

    name, seed, rate, out = args
    torch.set_num_threads(1)
    config = PipeMareConfig(**CANDIDATES[name])
    task = TASKS["gpt_c64"]
    run = run_task(task, "pipemare", STAGES, MICROBATCHES, rate, seed, config=config)
    record = {"candidate": name, "seed": seed, "final": run.metric[-1], "curve": run.metric}
    record["corrections"] = (run.setup or {}).get("corrections")
    (out / f"{_slug(name)}-s{seed}.json").write_text(json.dumps(record))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _stored(protocol: Path, schedule: str, p: int, n: int, rate: float, seed: int) -> float:
    path = protocol / "runs" / f"gpt_c64-{schedule}-P{p}-N{n}-lr{rate:g}-s{seed}.json"
    return json.loads(path.read_text())["metric"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--protocol", type=Path, default=Path("runs/c64"))
    parser.add_argument("--out", type=Path, default=Path("runs/ablation_c64"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    rate = json.loads((args.protocol / "rates.json").read_text())["gpt_c64"]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table:
        todo = [
            (name, seed, rate, args.out)
            for name in CANDIDATES
            for seed in args.seeds
            if not (args.out / f"{_slug(name)}-s{seed}.json").exists()
        ]
        with get_context("spawn").Pool(args.workers) as pool:
            pool.map(_train, todo, chunksize=1)
    one = [_stored(args.protocol, "gpipe", 2, 1, rate, s) for s in args.seeds]
    ref = statistics.fmean(one)
    rows = [("one device (gpipe)", one)]
    rows.append(
        ("default", [_stored(args.protocol, "pipemare", 4, 4, rate, s) for s in args.seeds])
    )
    rows.append(
        (
            "async (uncorrected)",
            [_stored(args.protocol, "async", 4, 4, rate, s) for s in args.seeds],
        )
    )
    for name in CANDIDATES:
        finals = [
            json.loads((args.out / f"{_slug(name)}-s{s}.json").read_text())["final"]
            for s in args.seeds
        ]
        rows.append((f"default + {name}", finals))
    print(f"gpt_c64, P = {STAGES}, N = {MICROBATCHES}, rate {rate:g}, seeds {args.seeds}\n")
    print("| corrections | final val loss (mean ± half-range) | vs one device |")
    print("|---|---|---|")
    for name, finals in rows:
        mean, half = statistics.fmean(finals), (max(finals) - min(finals)) / 2
        print(f"| {name} | {mean:.4f} ± {half:.4f} | {100 * (mean / ref - 1):+.2f}% |")


if __name__ == "__main__":
    main()
