"""Each stage's work per step at the blocks' cut and at the halves' cut: the forwards (F),
backwards (B) and updates (U) of every stage, in ms per step, measured in one process (every
stage simulated, one thread) over windows of steps after warm ones, as the protocol's step
times are, and the replayed step: per configuration the median over ``--repeats`` windows, the
windows of every configuration taken in turn (a drift of the machine's speed falls on all of
them alike). Run it alone on the machine (the durations are measured):

    OMP_NUM_THREADS=1 python experiments/results/horizon_halves/stage_costs.py --stages 4

It prints a Markdown table and writes ``stage_costs-P{P}.json`` beside this file.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--repeats", type=int, default=6, help="windows per configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)
    p = args.stages
    rows, record = [], []
    built = {}
    for name in ("gpt_c64s", "gpt_c64s_halves"):
        task = TASKS[name]
        data = task.data()[:2]
        for schedule in args.schedules:
            pipe = _pipeline(task, copy.deepcopy(_timed_model(name)), schedule, p, p, 1e-4, None, 0)
            timed_window(pipe, task, *data, args.warm, 0)
            built[(name, schedule)] = (task, data, pipe)
    windows: dict[tuple[str, str], list[tuple[list[dict[str, float]], float]]] = {
        key: [] for key in built
    }
    order = list(built)
    for r in range(args.repeats):  # windows in turn, each round starting one configuration later
        for key in order[r % len(order) :] + order[: r % len(order)]:
            task, (x, y), pipe = built[key]
            spans = timed_window(pipe, task, x, y, 0, args.steps)
            per = [dict.fromkeys("FBU", 0.0) for _ in range(p)]
            for stage, action, _, start, end in (s[:5] for s in spans):
                if action in ("F", "B", "U"):
                    per[stage][action] += 1000 * (end - start) / args.steps
            windows[key].append((per, 1000 * replay_timeline(spans, p)[1] / args.steps))
    for (name, schedule), got in windows.items():
        per_action = {
            a: [statistics.median(w[s][a] for w, _ in got) for s in range(p)] for a in "FBU"
        }
        work = [statistics.median(sum(w[s].values()) for w, _ in got) for s in range(p)]
        cell = {
            "task": name,
            "schedule": schedule,
            "N": p,
            "balance": list(built[(name, schedule)][2].balance),
            "windows": len(got),
            "ms_per_step": per_action,
            "stage_work_ms": work,
            "replayed_step_ms": statistics.median(step for _, step in got),
        }
        record.append(cell)
        rows.append(
            f"| {name} | {schedule} | {p} | {cell['balance']} | "
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
