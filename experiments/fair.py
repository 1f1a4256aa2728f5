"""``pipemare protocol``: the fair comparison of schedules, as every published table is built.

For each task and each (P, N) of the grid, each schedule runs at its own best learning rate
from a sweep (seed 0), then at that rate with more seeds. gpipe and 1f1b compute exactly what
single-device training of the minibatch computes (the transparency tests check it), so their
quality is run once per task; their pipeline time is measured at every N, and at N = 4P, their
best-case bubble. Then, measured alone on the machine, each configuration's pipeline time per
step (:func:`pipemare.experiments.protocol.step_time`). Outputs in ``OUT``: ``runs/*.json``
(one per run; a re-run skips those present), ``step_times.json``, ``results.json``,
``results.md`` and plots of quality against steps and against pipeline time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipemare import PipeMareConfig
from pipemare.experiments.protocol import TASKS, RunResult, Task

__all__ = ["GRID", "VARIANTS", "best_case_n", "main", "next_rate", "run_protocol"]

#: (P, N): the practical regime (N = 4, 8 at P = 8; N = 4 at P = 16) and the fine-grained one
#: (N = 1, one stage per layer-group).
GRID: tuple[tuple[int, int], ...] = ((8, 1), (8, 4), (8, 8), (16, 1), (16, 4))

_ALONE = {
    "lr_reschedule": False,
    "weight_prediction": False,
    "spike_compensation": False,
    "delay_momentum": None,
}

#: variant -> (schedule, config); ``pipemare`` is the schedule's default, the others take
#: its corrections one at a time (the ablation behind the default).
VARIANTS: dict[str, tuple[str, PipeMareConfig | None]] = {
    "gpipe": ("gpipe", None),
    "async": ("async", None),
    "pipemare": ("pipemare", None),
    "pipemare-T1T2": ("pipemare", PipeMareConfig.t1_t2()),
    "pipemare-T1": ("pipemare", PipeMareConfig(**{**_ALONE, "lr_reschedule": True})),
    "pipemare-SC": ("pipemare", PipeMareConfig(**{**_ALONE, "spike_compensation": True})),
    "pipemare-WP": ("pipemare", PipeMareConfig(**{**_ALONE, "weight_prediction": True})),
    "pipemare-SC-WP": (
        "pipemare",
        PipeMareConfig(**{**_ALONE, "spike_compensation": True, "weight_prediction": True}),
    ),
    # Ajanthan et al.'s Nesterov method without a stash: momentum rising with the delay, the
    # look-ahead from weight prediction
    "pipemare-WP-DM": (
        "pipemare",
        PipeMareConfig(**{**_ALONE, "weight_prediction": True, "delay_momentum": 0.99}),
    ),
    # the default before delay-aware momentum joined it (pipemare 0.2)
    "pipemare-T1-SC-WP": ("pipemare", PipeMareConfig(delay_momentum=None)),
}

#: what the protocol compares unless told otherwise
DEFAULT_VARIANTS = ("gpipe", "async", "pipemare", "pipemare-T1-SC-WP")

SYNC = ("gpipe",)

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


@dataclasses.dataclass(frozen=True)
class Job:
    task: str
    variant: str
    stages: int
    microbatches: int
    lr: float
    seed: int
    steps: int | None = None

    @property
    def key(self) -> str:
        return (
            f"{self.task}-{self.variant}-P{self.stages}-N{self.microbatches}"
            f"-lr{self.lr:g}-s{self.seed}"
        )


def _run(job: Job) -> dict[str, Any]:
    import torch

    from pipemare.experiments.protocol import train

    torch.set_num_threads(1)  # one core per run: two runs share this machine's two cores
    schedule, config = VARIANTS[job.variant]
    result = train(
        TASKS[job.task],
        schedule,
        job.stages,
        job.microbatches,
        job.lr,
        job.seed,
        config,
        job.variant,
        steps=job.steps,
    )
    return dataclasses.asdict(result)


def _configs(task: str, variant: str, grid: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    # gpipe's quality does not depend on P or N: one configuration stands for all.
    return [next(iter(grid))] if variant in SYNC else list(grid)


def _execute(jobs: list[Job], out: Path, workers: int, label: str) -> None:
    from tqdm import tqdm

    todo = [j for j in jobs if not (out / "runs" / f"{j.key}.json").exists()]
    if not todo:
        return
    (out / "runs").mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool, tqdm(total=len(todo), desc=label, unit="run") as bar:
        for job, result in zip(todo, pool.imap(_run, todo), strict=True):
            (out / "runs" / f"{job.key}.json").write_text(json.dumps(result))
            bar.set_postfix_str(job.key, refresh=False)
            bar.update()


def _load(out: Path, job: Job) -> RunResult:
    return RunResult(**json.loads((out / "runs" / f"{job.key}.json").read_text()))


def next_rate(lr: float, up: bool) -> float:
    """The neighbour of ``lr`` on the 1-3-10 grid of learning rates.

    Example:
        >>> next_rate(3e-3, up=True), next_rate(1e-3, up=True), next_rate(3e-4, up=False)
        (0.01, 0.003, 0.0001)
    """
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = lr / 10**exponent
    low = mantissa < 2  # 1 (else 3)
    if up:
        return float(f"{(3 if low else 10) * 10**exponent:.1g}")
    return float(f"{(0.3 if low else 1) * 10**exponent:.1g}")


def _best_lr(out: Path, task: Task, jobs: list[Job]) -> float:
    scores = [(_load(out, j).best(task.higher_is_better), j.lr) for j in jobs]
    sign = 1 if task.higher_is_better else -1
    return max(scores, key=lambda s: (sign * s[0], -s[1]))[1]


def run_protocol(
    out: Path,
    tasks: list[str],
    variants: list[str],
    grid: tuple[tuple[int, int], ...] = GRID,
    seeds: int = 2,
    workers: int = 2,
    steps: int | None = None,
    lrs: tuple[float, ...] | None = None,
    time_steps: int = 32,
    phase: str = "all",
    extend: int = 1,
) -> dict[str, Any]:
    """Sweep, seed, time and tabulate; returns what ``results.json`` holds.

    ``phase="times"`` only measures the pipeline times (run it with nothing else on the
    machine); ``"runs"`` only trains (timing-insensitive: it may share the machine);
    ``"table"`` trains what is missing and tabulates with the times measured so far. A best
    rate at the edge of the sweep gets the next rate beyond it, ``extend`` times at most.
    """
    out.mkdir(parents=True, exist_ok=True)
    if phase == "times":
        return {"step_times": _step_times(out, tasks, variants, grid, time_steps)}
    sweep = {
        (t, v, p, n): [
            Job(t, v, p, n, lr, 0, steps) for lr in (lrs if lrs is not None else TASKS[t].lrs)
        ]
        for t in tasks
        for v in variants
        for p, n in _configs(t, v, grid)
    }
    _execute([j for js in sweep.values() for j in js], out, workers, "learning-rate sweep")
    for _ in range(extend):  # a best rate at the sweep's edge: one more rate beyond it
        more = []
        for key, js in sweep.items():
            rates = sorted({j.lr for j in js})
            best_rate = _best_lr(out, TASKS[key[0]], js)
            if len(rates) > 1 and best_rate in (rates[0], rates[-1]):
                job = Job(*key, next_rate(best_rate, up=best_rate == rates[-1]), 0, steps)
                js.append(job)
                more.append(job)
        if not more:
            break
        _execute(more, out, workers, "rates beyond the sweep's edge")
    best = {key: _best_lr(out, TASKS[key[0]], js) for key, js in sweep.items()}
    seeded = {key: [Job(*key, best[key], s, steps) for s in range(seeds)] for key in sweep}
    _execute([j for js in seeded.values() for j in js], out, workers, "seeds at the best rate")
    if phase == "runs":
        return {}
    if phase == "table":  # the pipeline times measured so far, nothing new
        path = out / "step_times.json"
        times = json.loads(path.read_text()) if path.exists() else {}
    else:
        times = _step_times(out, tasks, variants, grid, time_steps)
    results = _tabulate(out, tasks, variants, grid, seeded, times)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(_markdown(results))
    _plot(out, results, seeded)
    return results


def best_case_n(task: Task, stages: int) -> int:
    """gpipe's and 1f1b's N of least bubble: 4P, or as many as the minibatch has samples."""
    return min(4 * stages, task.batch)


def _time_keys(
    task: Task, variants: list[str], grid: Iterable[tuple[int, int]]
) -> list[tuple[str, int, int]]:
    keys = []
    for p, n in grid:
        for v in [*variants, "1f1b"]:
            keys.append((v, p, n))
        keys += [("gpipe", p, best_case_n(task, p)), ("1f1b", p, best_case_n(task, p))]
    return list(dict.fromkeys(keys))


def _step_times(
    out: Path, tasks: list[str], variants: list[str], grid: tuple[tuple[int, int], ...], steps: int
) -> dict[str, float]:
    """Pipeline seconds per step of every (task, schedule, P, N), measured one at a time."""
    import torch
    from tqdm import tqdm

    from pipemare.experiments.protocol import step_time

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


def _first_reach(run: RunResult, target: float, higher: bool) -> float:
    for step, value in zip(run.steps, run.metric, strict=True):
        if math.isfinite(value) and (value >= target if higher else value <= target):
            return float(step)
    return math.inf


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / 2 if len(values) > 1 else 0.0


def _plateau(runs: list[RunResult], higher: bool) -> float:
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


def _tabulate(
    out: Path,
    tasks: list[str],
    variants: list[str],
    grid: tuple[tuple[int, int], ...],
    seeded: dict[tuple[str, str, int, int], list[Job]],
    times: dict[str, float],
) -> dict[str, Any]:
    results: dict[str, Any] = {"grid": grid, "tasks": {}}
    for t in tasks:
        task = TASKS[t]
        higher = task.higher_is_better
        sync_key = next(k for k in seeded if k[0] == t and k[1] in SYNC)
        sync_runs = [_load(out, j) for j in seeded[sync_key]]
        sync_best = [r.best(higher) for r in sync_runs]
        # gpipe's final quality: the level every gpipe seed reached (the weaker seed's best)
        target = min(sync_best) if higher else max(sync_best)
        sync_steps = statistics.fmean(_first_reach(r, target, higher) for r in sync_runs)
        rows = []
        for p, n in grid:
            for v in variants:
                key = next(
                    k for k in seeded if k[0] == t and k[1] == v and (v in SYNC or k[2:] == (p, n))
                )
                runs = [_load(out, j) for j in seeded[key]]
                best = [r.best(higher) for r in runs]
                reach = [_first_reach(r, target, higher) for r in runs]
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
                        "spread": _spread(best),
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
            "gpipe_plateau_gain": _plateau(sync_runs, higher),
            "rows": rows,
        }
    return results


def _fmt(x: Any, spec: str = ".3f") -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return "never" if x > 0 else "–"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _compact(results: dict[str, Any]) -> list[str]:
    """One table over tasks: best quality per (P, N) and schedule, and pipemare's time ratio."""
    tasks = results["tasks"]
    variants = list(
        dict.fromkeys(r["schedule"] for t in tasks.values() for r in t["rows"] if "best" in r)
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
                cells.append("" if x is None else f"{x['best']:.3f} ± {x['spread']:.3f}")
            x = rows.get("pipemare")
            cells.append("" if x is None else _fmt(x["time_vs_gpipe"], ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _markdown(results: dict[str, Any]) -> str:
    lines = ["### All tasks", "", *_compact(results), ""]
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


def _plot(
    out: Path, results: dict[str, Any], seeded: dict[tuple[str, str, int, int], list[Job]]
) -> None:
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
                runs = [_load(out, j) for j in jobs]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pipemare protocol",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/protocol"))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=sorted(TASKS))
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS)
    )
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the task's)")
    parser.add_argument("--lrs", type=float, nargs="+", help="learning rates swept")
    parser.add_argument("--grid", nargs="+", help="P:N pairs (default: 8:1 8:4 8:8 16:1 16:4)")
    parser.add_argument(
        "--phase",
        choices=("all", "runs", "times", "table"),
        default="all",
        help="runs: train only; times: measure pipeline times only (alone on the machine); "
        "table: train what is missing and tabulate with the times measured so far",
    )
    args = parser.parse_args(argv)
    grid = GRID
    if args.grid:
        grid = tuple((int(p), int(n)) for p, n in (g.split(":") for g in args.grid))
    if "gpipe" not in args.variants:
        parser.error("the protocol compares against gpipe: keep it in --variants")
    run_protocol(
        args.out,
        args.tasks,
        args.variants,
        grid,
        args.seeds,
        args.workers,
        args.steps,
        tuple(args.lrs) if args.lrs else None,
        phase=args.phase,
    )
    if args.phase in ("all", "table"):
        print((args.out / "results.md").read_text())
