"""Each stage's work per step at the blocks' cut and at the halves' cut: the forwards (F),
backwards (B) and updates (U) of every stage, in ms per step, measured in one process (every
stage simulated, one thread) over a window of steps after warm ones, as the protocol's step
times are; and the replayed step. Run it alone on the machine (the durations are measured):

    OMP_NUM_THREADS=1 python experiments/results/horizon_halves/stage_costs.py --stages 4

It prints a Markdown table and writes ``stage_costs-P{P}.json`` beside this file.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from pipemare.engine.telemetry import replay_timeline
from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "async", "pipemare"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    p = args.stages
    rows, record = [], []
    for name in ("gpt_c64s", "gpt_c64s_halves"):
        task = TASKS[name]
        x, y, _, _ = task.data()
        for schedule in args.schedules:
            pipe = _pipeline(task, copy.deepcopy(_timed_model(name)), schedule, p, p, 1e-4, None, 0)
            spans = timed_window(pipe, task, x, y, args.warm, args.steps)
            per: dict[tuple[int, str], float] = collections.defaultdict(float)
            for stage, action, _, start, end in (s[:5] for s in spans):
                if action in ("F", "B", "U"):
                    per[(stage, action)] += 1000 * (end - start) / args.steps
            _, makespan = replay_timeline(spans, p)
            work = [sum(per[(s, a)] for a in "FBU") for s in range(p)]
            cell = {
                "task": name,
                "schedule": schedule,
                "N": p,
                "balance": list(pipe.balance),
                "ms_per_step": {a: [per[(s, a)] for s in range(p)] for a in "FBU"},
                "stage_work_ms": work,
                "replayed_step_ms": 1000 * makespan / args.steps,
            }
            record.append(cell)
            rows.append(
                f"| {name} | {schedule} | {p} | {pipe.balance} | "
                + " / ".join(f"{w:.1f}" for w in work)
                + f" | {max(work) / statistics.fmean(work):.2f} | {cell['replayed_step_ms']:.1f} |"
            )
    print(
        "| task | schedule | N | layers per stage | F+B+U per stage (ms/step) | busiest / mean "
        "| replayed step (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    out = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "cells": record,
    }
    (HERE / f"stage_costs-P{p}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
