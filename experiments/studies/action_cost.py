"""Where a schedule's step goes: each action's measured cost, and what the replay adds to it.

The protocol's step time (:func:`~pipemare.experiments.studies.protocol.step_times`) replays
actions measured in one process with every stage on a device of its own. This study splits that
replayed step into two factors, per schedule:

- **busy**: the compute of the busiest stage per step, the sum of its forwards (F), backwards
  (B) and updates (U). No schedule can step faster than this on P devices.
- **step / busy**: what the schedule's dependencies add on top (its bubble).

So that ``pipemare's step / 1F1B's = (busy ratio) x (step/busy ratio)``: the second factor is
where asynchrony pays (1F1B's fill and drain: (N + P - 1) / N of busy at best, an asynchronous
schedule's about 1), the first is what its actions cost more than 1F1B's (weight prediction in
the forward, the corrections' extra work in the backward and the update). With ``--profile``
it also runs each schedule's steps under :mod:`cProfile` and prints the functions that take
the most time of their own, to find where an action's extra cost goes.

Run alone on the machine (the durations are measured):

    python experiments/studies/action_cost.py --stages 4 --out experiments/results/action_cost

It writes ``OUT/action_cost-P{P}.json`` (every figure below, with the command) and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import shlex
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_TASK = "gpt_c64s"


def _measure(task: Any, schedule: str, stages: int, n: int, steps: int, warm: int) -> dict:
    """One window of ``steps`` steps after ``warm``: per stage and kind the seconds per step,
    the busiest stage's, and the replayed step."""
    from pipemare.engine.telemetry import replay_timeline
    from pipemare.experiments.studies.protocol import _pipeline, _timed_model, timed_window

    model = copy.deepcopy(_timed_model(task.name))
    x, y, _, _ = task.data()
    pipe = _pipeline(task, model, schedule, stages, n, 1e-4, None, 0)
    spans = timed_window(pipe, task, x, y, warm, steps)
    _, makespan = replay_timeline(spans, stages)
    per: dict[str, list[float]] = {kind: [0.0] * stages for kind in ("F", "B", "U", "comm")}
    counts: dict[str, list[int]] = {kind: [0] * stages for kind in ("F", "B", "U")}
    for stage, name, _, start, end in spans:
        if name in ("recv", "send"):
            per["comm"][stage] += end - start
        else:
            per[name][stage] += end - start
            counts[name][stage] += 1
    busy = [sum(per[k][s] for k in ("F", "B", "U")) / steps for s in range(stages)]
    return {
        "seconds_per_step": {k: [v / steps for v in per[k]] for k in per},
        "actions_per_step": {k: [c / steps for c in counts[k]] for k in counts},
        "busy": max(busy),
        "step": makespan / steps,
    }


def _profile(task: Any, schedule: str, stages: int, n: int, steps: int, top: int) -> dict[str, Any]:
    """The ``top`` functions by their own CPU time over ``steps`` steps (after 4 warm ones)."""
    import torch

    from pipemare.experiments.studies.protocol import _pipeline, _timed_model

    model = copy.deepcopy(_timed_model(task.name))
    x, y, _, _ = task.data()
    pipe = _pipeline(task, model, schedule, stages, n, 1e-4, None, 0)
    rows = [torch.arange(k * task.batch, (k + 1) * task.batch) % len(x) for k in range(4 + steps)]
    batches = [(x[idx], y[idx]) for idx in rows]
    for batch in batches[:4]:
        pipe.step(batch)
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust to a busy machine
    profiler.enable()
    for batch in batches[4:]:
        pipe.step(batch)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return {"top": text.getvalue(), **_shares(stats, steps)}


def _shares(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """CPU seconds per step (all stages of this process together) in all, and in the saved-tensor
    hooks that let weights change between a forward and its backward (the no-stash pack and
    unpack, with what they call: the saved-bytes count among it)."""
    table = stats.stats  # type: ignore[attr-defined]
    hooks = sum(
        cum
        for (path, _, name), (_, _, _, cum, _) in table.items()
        if path.endswith("nostash.py") and name in ("pack", "_unpack")
    )
    total = stats.total_tt  # type: ignore[attr-defined]
    return {"cpu_s_per_step": total / steps, "hooks_cpu_s_per_step": hooks / steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps per window")
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="windows; the median is kept")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=None,
        help="SCHEDULE:N pairs (default: 1f1b, gpipe, async and pipemare at N = P, 1F1B also "
        "at 2P)",
    )
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top")
    parser.add_argument("--out", type=Path, default=_ROOT / "experiments/results/action_cost")
    args = parser.parse_args(argv)

    import torch

    from pipemare.experiments.studies.protocol import TASKS

    torch.set_num_threads(1)  # one core per stage's work, as the runs train
    task = TASKS[_TASK]
    p = args.stages
    runs = args.runs or [f"1f1b:{p}", f"1f1b:{2 * p}", f"gpipe:{p}", f"async:{p}", f"pipemare:{p}"]
    found: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "task": _TASK,
        "stages": p,
        "runs": {},
    }
    for spec in runs:
        schedule, n = spec.split(":")
        windows = [
            _measure(task, schedule, p, int(n), args.steps, args.warm) for _ in range(args.repeats)
        ]
        best = sorted(windows, key=lambda w: w["step"])[len(windows) // 2]  # the median window
        best["step_windows"] = [w["step"] for w in windows]
        found["runs"][spec] = best
        if args.profile:
            best["profile"] = _profile(task, schedule, p, int(n), args.steps, 25)
        step, busy = 1000 * best["step"], 1000 * best["busy"]
        print(f"{spec}: step {step:.1f} ms, busy {busy:.1f} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"action_cost-P{p}.json").write_text(json.dumps(found, indent=1))
    print(cost_table(found))


def cost_table(found: dict[str, Any]) -> str:
    """Markdown: per run, each kind's ms per step on the busiest stage, busy, step, step/busy,
    and against 1F1B at N = P."""
    runs = found["runs"]
    ref = runs.get(f"1f1b:{found['stages']}")
    lines = [
        "| schedule:N | F ms/step | B ms/step | U ms/step | F ms each | B ms each | busy (ms) "
        "| replayed step (ms) | step / busy | busy × 1F1B's | step × 1F1B's "
        "| CPU ms/step, all stages (profiled) | of it in saved-tensor hooks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, r in runs.items():
        sec, cnt = r["seconds_per_step"], r["actions_per_step"]
        stage = max(range(found["stages"]), key=lambda s: sec["F"][s] + sec["B"][s] + sec["U"][s])
        each = {k: 1000 * sec[k][stage] / cnt[k][stage] if cnt[k][stage] else 0.0 for k in "FB"}
        vs_busy = r["busy"] / ref["busy"] if ref else float("nan")
        vs_step = r["step"] / ref["step"] if ref else float("nan")
        lines.append(
            f"| {spec} | {1000 * sec['F'][stage]:.1f} | {1000 * sec['B'][stage]:.1f} "
            f"| {1000 * sec['U'][stage]:.1f} | {each['F']:.2f} | {each['B']:.2f} "
            f"| {1000 * r['busy']:.1f} | {1000 * r['step']:.1f} | {r['step'] / r['busy']:.2f} "
            f"| {vs_busy:.2f} | {vs_step:.2f} | {_cpu(r)} |"
        )
    return "\n".join(lines)


def _cpu(run: dict[str, Any]) -> str:
    prof = run.get("profile")
    if not prof:
        return " | "
    cpu, hooks = prof["cpu_s_per_step"], prof["hooks_cpu_s_per_step"]
    return f"{1000 * cpu:.1f} | {1000 * hooks:.1f} ({hooks / cpu:.0%})"


if __name__ == "__main__":
    main()
