"""The replayed step, links included, against real two-process steps (issue 62).

Two gloo processes (Lightning's launcher), one thread each; the experiments' GPT over the char
corpus, batch 16, AdamW; a step is the wall clock between training steps 10 and 30 on rank 0
(``experiments/studies/step_clock.py``). ``pipemare`` runs the default, whose first lines carry
the advice: its replayed step and 1F1B's at every N, with the links measured at setup (or the
simulated one); ``1f1b N`` runs 1F1B at N. ``--link 1Gb/s@1ms`` runs both over a simulated
link (``PipeMareStrategy(simulated_link=...)``). Run alone on the machine::

    python experiments/results/links/measure.py 192 8 64 pipemare [--link 1Gb/s@1ms]
    python experiments/results/links/measure.py 192 8 64 1f1b 4 [--link 1Gb/s@1ms]

Each run appends a ``RESULT`` line (JSON) to ``--out`` and prints it.
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from pipemare import PipeMareStrategy
from pipemare.experiments.studies.step_clock import gpt_and_schedule_arguments, timed_fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_and_schedule_arguments(parser)
    parser.add_argument("--link", help="a simulated link, e.g. 1Gb/s@1ms (default: the real one)")
    parser.add_argument("--sitting", type=int, default=1)
    parser.add_argument(
        "--devices", type=int, default=2, help="processes, one stage each (default 2)"
    )
    parser.add_argument(
        "--balance",
        help="layers per stage, e.g. 2,2,2,2 (a list keeps whole blocks; default: the time cut)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.jsonl")
    args = parser.parse_args()
    balance = [int(n) for n in args.balance.split(",")] if args.balance else "time"
    if args.schedule == "pipemare":
        strategy = PipeMareStrategy(simulated_link=args.link, balance=balance)
    else:
        strategy = PipeMareStrategy(
            schedule="1f1b",
            microbatches=args.n,
            advise=False,
            simulated_link=args.link,
            balance=balance,
        )
    trainer, step_ms = timed_fit(strategy, args.width, args.layers, args.context, args.devices)
    if trainer.global_rank != 0:
        return
    result = {
        "width": args.width,
        "layers": args.layers,
        "context": args.context,
        "schedule": args.schedule,
        "N": strategy.microbatches,
        "link": args.link or "real",
        "devices": args.devices,
        "sitting": args.sitting,
        "step_ms": step_ms,
    }
    advice = strategy.advice
    if advice is not None:
        result |= {
            "predicted_ms": advice.step_s * 1e3,
            "baseline_n": advice.baseline_n,
            "baseline_predicted_ms": {n: t * 1e3 for n, t in advice.baseline_by_n.items()},
        }
    plan = strategy._runner.plan  # the decisions the run printed
    said = {d.subject: str(d) for d in plan.decisions} if plan is not None else {}
    if args.balance:
        result["balance"] = args.balance
    for subject in ("links", "advice", "segments", "layers per stage"):
        if subject in said:
            result[subject] = said[subject]
    print("RESULT", json.dumps(result), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
