"""``pipemare protocol``: the fair comparison of schedules, as every published table is built.

For each task and each (P, N) of the grid, each schedule runs at its own best learning rate
from a sweep (seed 0), then at that rate with more seeds. gpipe and 1f1b compute exactly what
single-device training of the minibatch computes (the transparency tests check it), so their
quality is run once per task; their pipeline time is measured at every N, and at N = 4P, their
best-case bubble. Then, measured alone on the machine, each configuration's pipeline time per
step (:func:`pipemare.experiments.studies.protocol.step_time`). Outputs in ``OUT``:
``runs/*.json`` (one per run, with the setup it resolved; a re-run skips those present and
set up as the job is today, and trains again one whose setup changed), ``step_times.json``,
``results.json``, ``results.md`` and plots of quality against steps and against pipeline time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipemare.experiments._commands import add_tasks_argument, command_parser
from pipemare.experiments.studies.fair_report import (
    measure_step_times,
    plot,
    results_markdown,
    tabulate,
)
from pipemare.experiments.studies.grid import (
    DEFAULT_VARIANTS,
    GRID,
    SYNC,
    VARIANTS,
    Job,
    load_result,
)
from pipemare.experiments.studies.protocol import TASKS, Task


def _run(job: Job) -> dict[str, Any]:
    import torch

    from pipemare.experiments.studies.protocol import run_task

    torch.set_num_threads(1)  # one core per run: two runs share this machine's two cores
    schedule, config = VARIANTS[job.variant]
    result = run_task(
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


@functools.cache
def _model(task: str) -> Any:
    import torch

    torch.manual_seed(0)
    return TASKS[task].build()


@functools.cache
def _expected_setup(job: Job) -> dict[str, Any]:
    from pipemare.experiments.studies.protocol import run_setup

    schedule, config = VARIANTS[job.variant]
    task = TASKS[job.task]
    setup = run_setup(
        task, schedule, job.stages, job.microbatches, job.lr, config, job.steps, _model(job.task)
    )
    return json.loads(json.dumps(setup))  # as a stored run holds it


def _changes(stored: dict[str, Any], now: dict[str, Any]) -> str:
    keys = sorted(set(stored) | set(now))
    return "; ".join(
        f"{k}: {stored.get(k)!r} -> {now.get(k)!r}" for k in keys if stored.get(k) != now.get(k)
    )


def _todo(jobs: list[Job], out: Path, label: str) -> list[Job]:
    """The jobs to train: those with no stored run, and those whose stored run was set up
    differently from what the job resolves to today (a default changed since; said on stderr).
    A run stored before setups were recorded is used as it is, and counted."""
    todo, legacy = [], 0
    for job in jobs:
        path = out / "runs" / f"{job.key}.json"
        if not path.exists():
            todo.append(job)
            continue
        stored = json.loads(path.read_text()).get("setup")
        if stored is None:
            legacy += 1
        elif stored != (now := _expected_setup(job)):
            print(
                f"{job.key}: set up differently now, trained again ({_changes(stored, now)})",
                file=sys.stderr,
            )
            todo.append(job)
    if legacy:
        print(
            f"{label}: {legacy} stored run(s) predate recorded setups and are used as they are; "
            "delete them to train them with today's defaults",
            file=sys.stderr,
        )
    return todo


def execute(jobs: list[Job], out: Path, workers: int, label: str) -> None:
    """Train the jobs with no stored run (or one set up differently), ``workers`` at a time
    (one: in this process), each into ``out/runs/KEY.json``."""
    from tqdm import tqdm

    todo = _todo(jobs, out, label)
    if not todo:
        return
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if workers <= 1:  # in this process: no interpreter to start
        import torch

        threads = torch.get_num_threads()
        try:
            for job in tqdm(todo, desc=label, unit="run"):
                (out / "runs" / f"{job.key}.json").write_text(json.dumps(_run(job)))
        finally:
            torch.set_num_threads(threads)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool, tqdm(total=len(todo), desc=label, unit="run") as bar:
        for job, result in zip(todo, pool.imap(_run, todo), strict=True):
            (out / "runs" / f"{job.key}.json").write_text(json.dumps(result))
            bar.set_postfix_str(job.key, refresh=False)
            bar.update()


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


def best_rate(out: Path, task: Task, jobs: list[Job]) -> float:
    """The rate of ``jobs`` (one seed each) with the best metric; a tie goes to the lower rate."""
    scores = [(load_result(out, j).best(task.higher_is_better), j.lr) for j in jobs]
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
        return {"step_times": measure_step_times(out, tasks, variants, grid, time_steps)}
    sweep = {
        (t, v, p, n): [
            Job(t, v, p, n, lr, 0, steps) for lr in (lrs if lrs is not None else TASKS[t].lrs)
        ]
        for t in tasks
        for v in variants
        for p, n in _configs(t, v, grid)
    }
    execute([j for js in sweep.values() for j in js], out, workers, "learning-rate sweep")
    for _ in range(extend):  # a best rate at the sweep's edge: one more rate beyond it
        more = []
        for key, js in sweep.items():
            if any(load_result(out, j).refused for j in js):
                continue  # refused at setup: another rate would be refused too
            rates = sorted({j.lr for j in js})
            best = best_rate(out, TASKS[key[0]], js)
            if len(rates) > 1 and best in (rates[0], rates[-1]):
                job = Job(*key, next_rate(best, up=best == rates[-1]), 0, steps)
                js.append(job)
                more.append(job)
        if not more:
            break
        execute(more, out, workers, "rates beyond the sweep's edge")
    best = {key: best_rate(out, TASKS[key[0]], js) for key, js in sweep.items()}
    seeded = {key: [Job(*key, best[key], s, steps) for s in range(seeds)] for key in sweep}
    execute([j for js in seeded.values() for j in js], out, workers, "seeds at the best rate")
    if phase == "runs":
        return {}
    if phase == "table":  # the pipeline times measured so far, nothing new
        path = out / "step_times.json"
        times = json.loads(path.read_text()) if path.exists() else {}
    else:
        times = measure_step_times(out, tasks, variants, grid, time_steps)
    results = tabulate(out, tasks, variants, grid, seeded, times)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_markdown(results))
    plot(out, results, seeded)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pipemare protocol", __doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/protocol"))
    add_tasks_argument(parser, sorted(TASKS), list(TASKS))
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
