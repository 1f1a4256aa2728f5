"""The fair protocol's results: pipeline time per step, steps and time to reach a target, plateaus
with their spread, tables and plots.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipemare.experiments.studies.grid import SYNC, VARIANTS, Job, best_case_n, load_result
from pipemare.experiments.studies.protocol import TASKS, RunResult, Task

_COLORS = {
    "gpipe": "#1f77b4",
    "async": "#ff7f0e",
    "pipemare": "#2ca02c",
    "pipemare-T1T2": "#d62728",
    "pipemare-T1": "#9467bd",
    "pipemare-SC": "#8c564b",
    "pipemare-WP": "#e377c2",
    "pipemare-SC-WP": "#7f7f7f",
    "pipemare-WP-DM": "#bcbd22",
    "pipemare-T1-SC-WP": "#17becf",
}


def _time_keys(
    task: Task, variants: list[str], grid: Iterable[tuple[int, int]]
) -> list[tuple[str, int, int]]:
    keys = []
    for p, n in grid:
        for v in [*variants, "1f1b"]:
            keys.append((v, p, n))
        keys += [("gpipe", p, best_case_n(task, p)), ("1f1b", p, best_case_n(task, p))]
    return list(dict.fromkeys(keys))


def measure_step_times(
    out: Path, tasks: list[str], variants: list[str], grid: tuple[tuple[int, int], ...], steps: int
) -> dict[str, float]:
    """Pipeline seconds per step of every (task, schedule, P, N), measured one at a time."""
    import torch
    from tqdm import tqdm

    from pipemare.experiments.studies.protocol import step_time

    path = out / "step_times.json"
    times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    todo = [
        (t, v, p, n)
        for t in tasks
        for v, p, n in _time_keys(TASKS[t], variants, grid)
        if f"{t}-{v}-P{p}-N{n}" not in times
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t, v, p, n in tqdm(todo, desc="pipeline time per step", unit="config"):
            schedule, config = VARIANTS.get(v, (v, None))
            times[f"{t}-{v}-P{p}-N{n}"] = step_time(TASKS[t], schedule, p, n, config, steps)
            path.write_text(json.dumps(times, indent=1))
    finally:
        torch.set_num_threads(threads)
    return times


def first_reach(run: RunResult, target: float, higher: bool) -> float:
    """The first evaluated step where ``run`` reached ``target`` (inf: never)."""
    for step, value in zip(run.steps, run.metric, strict=True):
        if math.isfinite(value) and (value >= target if higher else value <= target):
            return float(step)
    return math.inf


def spread(values: list[float]) -> float:
    """Half the range of ``values`` (0 for one)."""
    return (max(values) - min(values)) / 2 if len(values) > 1 else 0.0


def plateau(runs: list[RunResult], higher: bool) -> float:
    """How much gpipe's best improved over the last quarter of its run (mean over seeds)."""
    gains = []
    for r in runs:
        cut = 3 * r.steps[-1] / 4
        early = [m for s, m in zip(r.steps, r.metric, strict=True) if s <= cut]
        late = [m for s, m in zip(r.steps, r.metric, strict=True) if s > cut]
        if early and late:
            gain = (max(late) - max(early)) if higher else (min(early) - min(late))
            gains.append(max(gain, 0.0))
    return statistics.fmean(gains) if gains else math.nan


def tabulate(
    out: Path,
    tasks: list[str],
    variants: list[str],
    grid: tuple[tuple[int, int], ...],
    seeded: dict[tuple[str, str, int, int], list[Job]],
    times: dict[str, float],
) -> dict[str, Any]:
    """Per task and (P, N): each schedule's rate, quality over seeds, gap and time to gpipe."""
    results: dict[str, Any] = {"grid": grid, "tasks": {}}
    for t in tasks:
        task = TASKS[t]
        higher = task.higher_is_better
        sync_key = next(k for k in seeded if k[0] == t and k[1] in SYNC)
        sync_runs = [load_result(out, j) for j in seeded[sync_key]]
        sync_best = [r.best(higher) for r in sync_runs]
        # gpipe's final quality: the level every gpipe seed reached (the weaker seed's best)
        target = min(sync_best) if higher else max(sync_best)
        sync_steps = statistics.fmean(first_reach(r, target, higher) for r in sync_runs)
        rows = []
        for p, n in grid:
            for v in variants:
                key = next(
                    k for k in seeded if k[0] == t and k[1] == v and (v in SYNC or k[2:] == (p, n))
                )
                runs = [load_result(out, j) for j in seeded[key]]
                refused = next((r.refused for r in runs if r.refused), None)
                if refused:
                    rows.append({"P": p, "N": n, "schedule": v, "refused": refused})
                    continue
                best = [r.best(higher) for r in runs]
                reach = [first_reach(r, target, higher) for r in runs]
                steps_to = statistics.fmean(reach)
                per_step = times.get(f"{t}-{v}-P{p}-N{n}", math.nan)
                sync_per_step = times.get(f"{t}-gpipe-P{p}-N{n}", math.nan)
                mean = statistics.fmean(best)
                gap = mean - statistics.fmean(sync_best)
                rows.append(
                    {
                        "P": p,
                        "N": n,
                        "schedule": v,
                        "lr": seeded[key][0].lr,
                        "best": mean,
                        "spread": spread(best),
                        "seeds": best,
                        "gap": gap,
                        "relative_gap": gap / abs(statistics.fmean(sync_best)),
                        "steps_to_target": steps_to,
                        "step_time_s": per_step,
                        "time_to_target_s": steps_to * per_step,
                        "time_vs_gpipe": (steps_to * per_step) / (sync_steps * sync_per_step),
                        "diverged": sum(r.diverged for r in runs),
                    }
                )
            for v in ("1f1b",):
                per_step = times.get(f"{t}-{v}-P{p}-N{n}", math.nan)
                rows.append(
                    {
                        "P": p,
                        "N": n,
                        "schedule": v,
                        "step_time_s": per_step,
                        "time_vs_gpipe": per_step / times.get(f"{t}-gpipe-P{p}-N{n}", math.nan),
                    }
                )
            best_n = best_case_n(task, p)
            for v in ("gpipe", "1f1b"):
                per_step = times.get(f"{t}-{v}-P{p}-N{best_n}", math.nan)
                rows.append(
                    {
                        "P": p,
                        "N": best_n,
                        "schedule": v,
                        "step_time_s": per_step,
                        "time_vs_gpipe": per_step / times.get(f"{t}-gpipe-P{p}-N{n}", math.nan),
                    }
                )
        results["tasks"][t] = {
            "metric": "val_acc" if higher else "val_loss",
            "higher_is_better": higher,
            "tuned": task.tuned,
            "steps": sync_runs[0].steps[-1],
            "target": target,
            "gpipe_best": sync_best,
            "gpipe_plateau_gain": plateau(sync_runs, higher),
            "rows": rows,
        }
    results["verdicts"] = verdicts(results)
    return results


def _fmt(x: Any, spec: str = ".3f") -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return "never" if x > 0 else "–"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _compact(results: dict[str, Any]) -> list[str]:
    """One table over tasks: best quality per (P, N) and schedule, and pipemare's time ratio."""
    tasks = results["tasks"]
    variants = list(
        dict.fromkeys(
            r["schedule"]
            for t in tasks.values()
            for r in t["rows"]
            if "best" in r or "refused" in r
        )
    )
    head = ["P", "N"]
    for t in tasks:
        head += [f"{t} {v}" for v in variants]
        head.append(f"{t} pipemare time to target / gpipe's")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, n in results["grid"]:
        cells = [str(p), str(n)]
        for r in tasks.values():
            rows = {x["schedule"]: x for x in r["rows"] if x["P"] == p and x["N"] == n}
            for v in variants:
                x = rows.get(v)
                if x is None or "refused" in x:
                    cells.append("" if x is None else "refused")
                else:
                    cells.append(f"{x['best']:.3f} ± {x['spread']:.3f}")
            x = rows.get("pipemare")
            cells.append("" if x is None or "refused" in x else _fmt(x["time_vs_gpipe"], ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# What the default is held to against gpipe: within 2 accuracy points, or within 2% of its
# validation loss.
MARGIN = 0.02


def verdicts(
    results: dict[str, Any], schedule: str = "pipemare", baseline: str = "async"
) -> list[dict[str, Any]]:
    """Per task and (P, N): is ``schedule`` within ``MARGIN`` of gpipe (points of accuracy, or
    a fraction of gpipe's loss), below ``baseline`` by more than their two seed spreads, and
    diverged where ``baseline`` did not?"""
    cells = []
    for t, r in results["tasks"].items():
        higher = r["higher_is_better"]
        for p, n in results["grid"]:
            rows = {x["schedule"]: x for x in r["rows"] if (x["P"], x["N"]) == (p, n)}
            ours, base = rows.get(schedule), rows.get(baseline)
            if ours is None or base is None or "best" not in ours or "best" not in base:
                continue  # refused at setup, or not in this protocol
            sign = 1 if higher else -1
            shortfall = sign * (base["best"] - ours["best"])
            close = ours["gap"] >= -MARGIN if higher else ours["relative_gap"] <= MARGIN
            cells.append(
                {
                    "task": t,
                    "P": p,
                    "N": n,
                    "within_margin": close,
                    "below_baseline": shortfall > base["spread"] + ours["spread"],
                    "diverged_alone": ours["diverged"] > 0 and base["diverged"] == 0,
                }
            )
    return cells


def _gap(row: dict[str, Any], higher: bool) -> str:
    """A gap to gpipe ± its seed spread as a user reads it: accuracy points, or % of gpipe's
    loss."""
    if higher:
        return f"{100 * row['gap']:+.1f} ± {100 * row['spread']:.1f}"
    gpipe = abs(row["best"] - row["gap"])
    return f"{100 * row['relative_gap']:+.1f}% ± {100 * row['spread'] / gpipe:.1f}%"


def _verdict_lines(results: dict[str, Any]) -> list[str]:
    cells = results["verdicts"]  # as tabulate() found them
    if not cells:
        return []
    lines = [
        "### pipemare against gpipe and async",
        "",
        f"Gap to gpipe (mean over seeds, each at its best rate) in accuracy points, or in % of "
        f"gpipe's loss. The margin: {100 * MARGIN:.0f} points, or {100 * MARGIN:.0f}%. Below "
        "async: by more than the two seed spreads together.",
        "",
        "| task | P | N | async | pipemare | within the margin | below async | "
        "diverged where async did not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        r = results["tasks"][c["task"]]
        rows = {x["schedule"]: x for x in r["rows"] if (x["P"], x["N"]) == (c["P"], c["N"])}
        higher = r["higher_is_better"]
        ours = rows["pipemare"]
        lines.append(
            f"| {c['task']} | {c['P']} | {c['N']} | {_gap(rows['async'], higher)} | "
            f"{_gap(ours, higher)} | "
            f"{'yes' if c['within_margin'] else '**no**'} | "
            f"{'**yes**' if c['below_baseline'] else 'no'} | "
            f"{'**yes**' if c['diverged_alone'] else 'no'} |"
        )
    for n in sorted({c["N"] for c in cells}):
        at = [c for c in cells if c["N"] == n]
        lines.append(
            f"\nAt N = {n}: within the margin in {sum(c['within_margin'] for c in at)} of "
            f"{len(at)} cells; below async in {sum(c['below_baseline'] for c in at)}; diverged "
            f"where async did not in {sum(c['diverged_alone'] for c in at)}."
        )
    return [*lines, ""]


def results_markdown(results: dict[str, Any]) -> str:
    """``results.md``: the table over tasks, pipemare's verdicts, then one table per task."""
    lines = ["### All tasks", "", *_compact(results), "", *_verdict_lines(results)]
    for t, r in results["tasks"].items():
        tuned = "" if r["tuned"] else " (no default was tuned on this task)"
        lines += [
            f"### {t}: best {r['metric']}{tuned}",
            "",
            f"{r['steps']} steps; gpipe's final quality (the target) {r['target']:.3f}; "
            f"gpipe's best improved by {r['gpipe_plateau_gain']:.4f} over the last quarter of "
            "its run. Mean ± half-range over seeds, each schedule at its best rate; time is "
            "pipeline time (P devices, replayed), relative to gpipe at the same N.",
            "",
            "| P | N | schedule | lr | best | gap to gpipe | steps to target | ms/step | "
            "time to target vs gpipe |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            if "refused" in row:
                reason = row["refused"].replace("|", "/")
                lines.append(
                    f"| {row['P']} | {row['N']} | {row['schedule']} | | refused at setup: "
                    f"{reason} | | | | |"
                )
                continue
            if "best" not in row:
                lines.append(
                    f"| {row['P']} | {row['N']} | {row['schedule']} (time only) | | | | | "
                    f"{_fmt(1000 * row['step_time_s'], '.1f')} | "
                    f"step {_fmt(row['time_vs_gpipe'], '.2f')} |"
                )
                continue
            lines.append(
                f"| {row['P']} | {row['N']} | {row['schedule']} | {row['lr']:g} | "
                f"{row['best']:.3f} ± {row['spread']:.3f} | {row['gap']:+.3f} "
                f"({100 * row['relative_gap']:+.1f}%) | {_fmt(row['steps_to_target'], '.0f')} | "
                f"{_fmt(1000 * row['step_time_s'], '.1f')} | {_fmt(row['time_vs_gpipe'], '.2f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(
    out: Path, results: dict[str, Any], seeded: dict[tuple[str, str, int, int], list[Job]]
) -> None:
    """One PNG per task: quality against steps and against pipeline time, per (P, N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / "step_times.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    for t, r in results["tasks"].items():
        grid = results["grid"]
        fig, axes = plt.subplots(2, len(grid), figsize=(3.8 * len(grid), 7.0), squeeze=False)
        for col, (p, n) in enumerate(grid):
            rates: list[str] = []
            for key, jobs in seeded.items():
                if key[0] != t or (key[1] not in SYNC and key[2:] != (p, n)):
                    continue
                runs = [load_result(out, j) for j in jobs]
                steps = runs[0].steps
                mean = [statistics.fmean(v) for v in zip(*(r.metric for r in runs), strict=False)]
                per_step = times.get(f"{t}-{key[1]}-P{p}-N{n}", math.nan)
                style = {"label": key[1], "color": _COLORS.get(key[1])}
                axes[0][col].plot(steps[: len(mean)], mean, **style)
                axes[1][col].plot([s * per_step for s in steps[: len(mean)]], mean, **style)
                rates.append(f"{key[1].removeprefix('pipemare-')} {jobs[0].lr:.0e}")
            pairs = [", ".join(rates[i : i + 2]) for i in range(0, len(rates), 2)]
            axes[0][col].set_title(f"P={p}, N={n}; lr:\n" + "\n".join(pairs), fontsize=7)
            axes[0][col].set_xlabel("optimiser steps", fontsize=8)
            axes[1][col].set_xlabel("pipeline time (s, P devices)", fontsize=8)
            for ax in (axes[0][col], axes[1][col]):
                ax.axhline(r["target"], color="grey", lw=0.6, ls=":")
                ax.tick_params(labelsize=7)
        axes[0][0].set_ylabel(r["metric"], fontsize=8)
        axes[1][0].set_ylabel(r["metric"], fontsize=8)
        handles, labels = axes[0][-1].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
        fig.suptitle(f"{t}: mean over seeds; dotted: gpipe's final quality", fontsize=10)
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        fig.savefig(out / f"{t}_protocol.png", dpi=110)
        plt.close(fig)
