"""What a timed window's edges add to an asynchronous schedule's replayed step.

The protocol's step times (:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`,
which the horizon sittings and the main job use) replay a window of ``steps`` steps and divide
its makespan by ``steps``. The replay starts every stage idle and ends when the last action
does, so a schedule that never flushes pays one fill and one drain per window, which a run of
thousands of steps pays once; a flushing schedule pays its own fill and drain every step,
window or not. The planner's :func:`~pipemare.planner.cost.steady_step_time` reads the same
replay as the slowest stage's time between two of its updates inside the window instead, which
the edges do not reach.

This script times the task's configurations as a sitting does (windows in turn, one process,
run it alone on the machine) and reads every window both ways::

    OMP_NUM_THREADS=1 python experiments/results/horizon/window_edges.py --stages 2 4 8

and writes ``window_edges.json`` beside it: per P and configuration, both readings of every
window, and pipemare's ratio to 1F1B (at 1F1B's fastest N in that window's round) both ways.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "window_edges.json"


def _measure(task_name: str, p: int, steps: int, warm: int, repeats: int) -> dict[str, Any]:
    """Both readings of ``repeats`` windows of every configuration at ``p`` (see above)."""
    from pipemare.engine.telemetry import replay_timeline
    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window
    from pipemare.experiments.studies.user_protocol import one_f_one_b_ns
    from pipemare.planner.cost import steady_step_time

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    keys = [("1f1b", n) for n in one_f_one_b_ns(task, p)] + [("async", p), ("pipemare", p)]
    pipes = {}
    for schedule, n in keys:
        model = copy.deepcopy(_timed_model(task.name))
        pipes[f"{schedule}:{n}"] = _pipeline(task, model, schedule, p, n, 1e-4, None, 0)
    windows: dict[str, dict[str, list[float]]] = {k: {"edges": [], "steady": []} for k in pipes}
    for _ in range(repeats):
        for key, pipe in pipes.items():
            spans = timed_window(pipe, task, x, y, warm, steps)
            _, makespan = replay_timeline(spans, p)
            windows[key]["edges"].append(1000 * makespan / steps)
            windows[key]["steady"].append(1000 * steady_step_time(spans, p))
    ratios = {}
    for reading in ("edges", "steady"):
        for schedule in ("async", "pipemare"):
            per_round = []
            for r in range(repeats):
                best = min(v[reading][r] for k, v in windows.items() if k.startswith("1f1b:"))
                per_round.append(windows[f"{schedule}:{p}"][reading][r] / best)
            ratios[f"{schedule}/1f1b, {reading}"] = per_round
    return {"windows": windows, "ratios": ratios}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt_c64s")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=12, help="a sitting's window")
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found: dict[str, Any] = {
        "task": args.task,
        "steps": args.steps,
        "warm": args.warm,
        "repeats": args.repeats,
        "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for p in args.stages:
        found[f"P{p}"] = result = _measure(args.task, p, args.steps, args.warm, args.repeats)
        for key, v in result["windows"].items():
            edges, steady = statistics.median(v["edges"]), statistics.median(v["steady"])
            print(
                f"P = {p} {key}: {edges:.1f} ms with the edges, {steady:.1f} ms steady "
                f"({steady / edges:.3f})",
                flush=True,
            )
        for name, per_round in result["ratios"].items():
            print(
                f"P = {p} {name}: median {statistics.median(per_round):.3f}, rounds "
                + ", ".join(f"{r:.3f}" for r in per_round),
                flush=True,
            )
    found["end"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    OUT.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
