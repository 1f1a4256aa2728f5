"""The product's verdict in one file: where pipemare reaches 1F1B's quality sooner, per regime,
derived from the results that measured it. The README quotes its figures by key, and
``tests/experiments/test_verdict.py`` checks every quoted figure and that this file is what
the results give; a new measurement updates the results, then this file, then the figures.

    python experiments/studies/verdict.py          # writes experiments/results/verdict.json

Regimes (each entry names its results file and the command that wrote it):

- ``long``: the compute-bound GPT (``gpt_c64s``) at ten times the main job's length, at the
  task's rate (tuned on one device at 240 steps), per P: pipemare at the default N against
  1F1B at its fastest N, and uncorrected ``async``; ``long_rate`` says how much better one
  device does at its best rate at that length, and how the default does at each rate it also ran at.
- ``long_1gbps``: the same runs' pipeline time replayed over 1 Gb/s links at 1 ms.
- ``long_halves``: the same GPT at the same length, cut between each block's attention and its
  MLP as well (``gpt_c64s_halves``), every schedule on that cut: the P it ran at.
- ``short``: the user's protocol on a compute-bound GPT (``gpt_c64``, 300 steps, 3 seeds).
- ``dispatch``: the user's protocol on the small dispatch-bound tasks (2 seeds): in how many
  (task, P) cells pipemare is within 2% (1 point) of 1F1B at equal steps, and in how many
  1F1B reaches its quality sooner.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments" / "results" / "verdict.json"
HORIZON = "experiments/results/horizon/verdict.json"
HALVES = "experiments/results/horizon_halves/verdict.json"
SHORT = "experiments/results/user_protocol_c64/results.json"
DISPATCH = "experiments/results/user_protocol/results.json"


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _per_p(study: dict[str, Any], source: str, command: str) -> dict[str, Any]:
    """The default N's cells of a horizon study at its longest length and the task's rate, per
    P: pipemare's (and ``async``'s, prefixed) gap, spread, seeds, time and step."""
    rate = study["task_rate"]
    at = [
        c
        for c in study["cells"]
        if c["lr"] == rate and c["schedule"] != "gpipe" and c["N"] == c["P"]
    ]
    steps = max(c["steps"] for c in at)
    entry: dict[str, Any] = {
        "what": (
            f"{study['task']}, compute-bound, {steps} steps ({steps // study['main_job_steps']}x"
            f" the main job's), rate {rate:g}, stages simulated in one process on CPU"
        ),
        "source": source,
        "command": command,
        "steps": steps,
    }
    for c in at:
        if c["steps"] != steps:
            continue
        cell = entry.setdefault(f"P{c['P']}", {})
        prefix = "" if c["schedule"] == "pipemare" else f"{c['schedule']}_"
        cell.update(
            {
                f"{prefix}gap": c["gap"],
                f"{prefix}spread": c["spread"] / (c["mean"] / (1 + c["gap"])),
                f"{prefix}seeds": len(c["seeds"]),
                f"{prefix}time": c["time_vs_1f1b"],
                f"{prefix}step": c["step_vs_1f1b"],
            }
        )
    for p, ratios in study.get("sitting_step_ratios", {}).items():
        if p in entry:  # the median of the sittings' own ratios, and how many sittings
            entry[p]["step_sittings"] = ratios["median"]
            entry[p]["sittings"] = len(ratios["each"])
    return entry


def _long(root: Path) -> dict[str, Any]:
    study = json.loads((root / HORIZON).read_text())
    rate = study["task_rate"]
    entry = _per_p(study, HORIZON, "python experiments/studies/horizon.py table")
    steps = entry["steps"]
    ones = {c["lr"]: c for c in study["cells"] if c["schedule"] == "gpipe" and c["steps"] == steps}
    best = min(ones.values(), key=lambda c: c["mean"])
    rates = {
        "what": f"one device at {steps} steps, final validation loss per rate",
        "source": HORIZON,
        "task_rate": rate,
        "best_rate": best["lr"],
        "best_gain": best["mean"] / ones[rate]["mean"] - 1,
        "best_factor": best["lr"] / rate,
        "rates_tried": len(ones),
        "seeds_at_best": len(best["seeds"]),
    }
    # every rate the default (or async) also ran at: one device's mean there and their cells (the
    # rates' keys as 2e-03, without a dot, so that a quoted key names them)
    by_rate: dict[str, Any] = {}
    for c in study["cells"]:
        default = c["schedule"] in ("pipemare", "async") and c["N"] == c["P"]
        if default and c["lr"] != rate and c["lr"] in ones and c["steps"] == steps:
            one = ones[c["lr"]]
            entry_rate = by_rate.setdefault(
                f"{c['lr']:.0e}",
                {"factor": c["lr"] / rate, "one_device": one["mean"], "seeds": len(one["seeds"])},
            )
            prefix = "" if c["schedule"] == "pipemare" else f"{c['schedule']}_"
            entry_rate.setdefault(f"P{c['P']}", {}).update(
                {
                    f"{prefix}gap": c["gap"],
                    f"{prefix}seeds": len(c["seeds"]),
                    f"{prefix}time": _finite(c["time_vs_1f1b"]),
                }
            )
    rates["by_rate"] = by_rate
    links: dict[str, Any] = {
        "what": f"the same runs' pipeline time replayed with every link 1 Gb/s at 1 ms ({steps} "
        "steps)",
        "source": HORIZON,
    }
    for c in study["over_links"].get("1Gb/s@1ms", []):
        if c["steps"] == steps and c["schedule"] == "pipemare" and c["N"] == c["P"]:
            links[f"P{c['P']}"] = {"time": c["time_vs_1f1b"], "step": c["step_vs_1f1b"]}
    halves = json.loads((root / HALVES).read_text())
    command = "python experiments/studies/horizon.py table --task gpt_c64s_halves"
    return {
        "long": entry,
        "long_rate": rates,
        "long_1gbps": links,
        "long_halves": _per_p(halves, HALVES, command),
    }


def _default_row(stage: dict[str, Any], schedule: str) -> dict[str, Any]:
    return next(r for r in stage["rows"] if r["schedule"] == schedule and r.get("default_n"))


def _gap(final: float, base: float, higher: bool) -> float:
    """Relative for a loss; in points (a fraction of 1) for an accuracy, worse positive."""
    return base - final if higher else final / base - 1


def _short(root: Path) -> dict[str, Any]:
    results = json.loads((root / SHORT).read_text())
    ((name, task),) = results["tasks"].items()
    entry: dict[str, Any] = {
        "what": (
            f"{name}, compute-bound, {task['steps']} steps, rate {task['rate']:g}, "
            f"{results['seeds']} seeds, stages simulated on CPU"
        ),
        "source": SHORT,
        "command": "pipemare user-protocol",
        "steps": task["steps"],
    }
    for p, stage in task["stages"].items():
        row = _default_row(stage, "pipemare")
        entry[f"P{p}"] = {
            "gap": _gap(row["final"], task["final_1f1b"], task["higher_is_better"]),
            "time": _finite(row["time_vs_1f1b"]),
            "step": row["step_time_s"] / stage["1f1b"]["step_time_s"],
        }
    return entry


def _dispatch(root: Path) -> dict[str, Any]:
    results = json.loads((root / DISPATCH).read_text())
    cells = within = sooner = 0
    times = []
    for task in results["tasks"].values():
        for stage in task["stages"].values():
            row = _default_row(stage, "pipemare")
            gap = _gap(row["final"], task["final_1f1b"], task["higher_is_better"])
            cells += 1
            within += gap <= (0.01 if task["higher_is_better"] else 0.02)
            ratio = row["time_vs_1f1b"]
            sooner += not ratio < 1
            if math.isfinite(ratio):
                times.append(ratio)
    return {
        "dispatch": {
            "what": (
                f"{len(results['tasks'])} dispatch-bound tasks at P = 2, 4, 8, "
                f"{results['seeds']} seeds"
            ),
            "source": DISPATCH,
            "command": "pipemare user-protocol",
            "tasks": len(results["tasks"]),
            "cells": cells,
            "within": within,
            "one_f_one_b_sooner": sooner,
            "time_min": min(times),
            "time_max": max(times),
        }
    }


def build_verdict(root: Path = ROOT) -> dict[str, Any]:
    return {
        "about": (
            "Where pipemare reaches 1F1B's final quality sooner, per regime: gap, pipemare's "
            "final quality against 1F1B's at equal steps (relative for a loss, in points for an "
            "accuracy; positive is worse); time, its pipeline time to 1F1B's final quality as "
            "a ratio of 1F1B's (null: never within the run); step, its step time as a ratio of "
            "1F1B's at its fastest N. Written by experiments/studies/verdict.py from each "
            "entry's source; do not edit by hand."
        ),
        **_long(root),
        "short": _short(root),
        **_dispatch(root),
    }


def main() -> None:
    OUT.write_text(json.dumps(build_verdict(), indent=1) + "\n")
    print(f"{OUT.relative_to(ROOT)} written")


if __name__ == "__main__":
    main()
