"""The dashboard's tables: runs ranked by their monitored value, each one's gap to gpipe, and the
one-line answer; apart from them, what was measured on this machine.

The results table and the answer read nothing measured by a clock (pipeline time is replayed
from per-action times measured once), so two studies give the same ones; wall time and
measured utilisation, which differ from run to run, are in :func:`measured_table` only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipemare.experiments.dashboard.runs import Run, memory_mb


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _reference(run: Run, runs: list[Run]) -> Run | None:
    """The gpipe run ``run`` is measured against: same task, and the same stages and
    microbatches where such a run exists (else the same stages, else any)."""
    gpipes = [r for r in runs if r.task == run.task and r.base_variant == "gpipe"]
    gpipes = [r for r in gpipes if r.summary.get("best") is not None]

    def same(r: Run, *keys: str) -> bool:
        return all(r.summary.get(k) == run.summary.get(k) for k in keys)

    for keys in (("stages", "microbatches"), ("stages",), ()):
        matches = [r for r in gpipes if same(r, *keys)]
        if matches:
            return matches[0]
    return None


def ranked(runs: list[Run]) -> list[Run]:
    """Runs by task (in order of first appearance), best first within a task; runs without a
    best value last."""
    order = {task: i for i, task in reversed(list(enumerate(r.task for r in runs)))}

    def key(run: Run) -> tuple[int, int, float]:
        best = run.summary.get("best")
        if best is None:
            return order[run.task], 1, 0.0
        return order[run.task], 0, -best if run.mode == "max" else best

    return sorted(runs, key=key)


def gap(run: Run, reference: Run | None) -> str:
    """``best − gpipe's best`` with its relative size, signed so that the reader sees the
    direction of the metric (for a loss, positive is worse)."""
    best = run.summary.get("best")
    if reference is None or best is None:
        return "-"
    ref = reference.summary["best"]
    delta = best - ref
    relative = f" ({100 * delta / abs(ref):+.1f}%)" if ref else ""
    return f"{delta:+.3f}{relative}"


def _delta(value: float | None, ref: float | None) -> str:
    if value is None or ref is None:
        return "-"
    relative = f" ({100 * (value - ref) / abs(ref):+.1f}%)" if ref else ""
    return f"{value - ref:+.3f}{relative}"


def equal_budgets(run: Run, reference: Run | None) -> tuple[float | None, float | None]:
    """``run``'s best within gpipe's pipeline time and within gpipe's steps (None: unknown)."""
    if reference is None:
        return None, None
    seconds = reference.total_pipeline_time
    steps = reference.summary.get("global_step")
    at_time = run.best_until(seconds=seconds) if seconds is not None else None
    return at_time, run.best_until(steps=steps)


def results_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """The final-quality table: one row per run, ranked within each task, with its gap to gpipe."""
    header = [
        "rank",
        "task",
        "run",
        "stages",
        "N",
        "lr",
        "best",
        "gap to gpipe",
        "at gpipe's time",
        "at gpipe's steps",
        "final",
        "steps to target",
        "pipeline s",
        "stash MB",
        "correction buffers MB",
        "status",
    ]
    rows = []
    rank, task = 0, None
    for run in ranked(runs):
        rank = rank + 1 if run.task == task else 1
        task = run.task
        s = run.summary
        mem = s.get("memory", {}).get("stages", [])
        final = s["final"].get(run.monitor)
        reference = _reference(run, runs)
        ref_best = None if reference is None else reference.summary.get("best")
        at_time, at_steps = equal_budgets(run, reference)
        rows.append(
            [
                str(rank),
                run.task,
                run.variant,
                _fmt(s.get("stages")),
                _fmt(s.get("microbatches")),
                _fmt(run.lr, 4),
                f"{run.monitor} {_fmt(s.get('best'))}",
                gap(run, reference),
                _delta(at_time, ref_best),
                _delta(at_steps, ref_best),
                _fmt(final),
                _fmt(s.get("steps_to_target")),
                _fmt(run.total_pipeline_time, 1),
                _fmt(sum(m["stash_mb"] for m in mem), 2) if mem else "-",
                _fmt(sum(memory_mb(m, "correction_buffers_mb") for m in mem), 2) if mem else "-",
                s["status"],
            ]
        )
    return header, rows


def measured_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """What the clock read during each run (it differs from run to run, and nothing in the
    results table depends on it): the monitor's pipeline time, wall time, utilisation."""
    header = ["task", "run", "measured pipeline s", "wall s", "utilisation"]
    rows = []
    for run in ranked(runs):
        s = run.summary
        util = run.last_stage_values("utilization")
        wall = _fmt(s.get("wall_time_s"), 0)
        measured = s.get("measured_pipeline_time_s", s.get("pipeline_time_s"))
        rows.append(
            [
                run.task,
                run.variant,
                _fmt(measured, 1),
                f"{wall} (serial)" if run.simulated and wall != "-" else wall,
                _fmt(float(np.nanmean(util)) if util and not all(np.isnan(util)) else None, 2),
            ]
        )
    return header, rows


def answer(runs: list[Run]) -> list[str]:
    """One sentence per task: which run did best, and how each PipeMare run compares to gpipe;
    where the runs had gpipe's pipeline time as their budget, a second one at gpipe's steps."""
    lines = []
    tasks: dict[str, list[Run]] = {}
    for run in ranked(runs):
        tasks.setdefault(run.task, []).append(run)
    for task, task_runs in tasks.items():
        scored = [r for r in task_runs if r.summary.get("best") is not None]
        if not scored:
            continue
        top = scored[0]
        text = f"{task}: best {top.monitor} {_fmt(top.summary['best'])} by {top.variant}"
        reference = _reference(top, runs)
        if reference is not None:
            text += f"; gpipe {_fmt(reference.summary['best'])}"
            mares = [r for r in scored if "pipemare" in r.variant]
            if not any(r.summary.get("budget_s") for r in mares):
                text += "".join(f"; {r.variant} {gap(r, _reference(r, runs))}" for r in mares)
            else:
                ref = reference.summary["best"]
                views = {r.variant: equal_budgets(r, _reference(r, runs)) for r in mares}
                seconds = _fmt(reference.total_pipeline_time, 1)
                text += f"; in gpipe's pipeline time ({seconds} s on P devices)"
                text += "".join(f"; {v} {_delta(t, ref)}" for v, (t, _) in views.items())
                text += f". At gpipe's {reference.summary.get('global_step')} steps"
                text += "".join(f"; {v} {_delta(n, ref)}" for v, (_, n) in views.items())
        lines.append(text + ".")
    return lines


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
