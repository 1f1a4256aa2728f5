"""Issue 40's ablation at P = 2: why the default pipeline trains worse than no correction there.

The corrections the config switches run through ``pipemare protocol`` (the grid's variants,
:data:`~pipemare.experiments.studies.grid.VARIANTS`). This module runs what a config cannot
express, into the same directory under the same job keys (:data:`EXTRA`): another optimiser
(the AsyncPP recipe, NAdam with β1 = 0.99; Adam with β1 = 0.99 to tell the look-ahead from the
momentum) and a rate factor per stage (``1/(1 + τ_i)``), then tabulates the final validation
quality at equal steps, mean ± half-range over the seeds, at the one rate per task the user
tuned on one device (gpipe's sweep). Commands and results: docs/results.md, "Why the default
loses at P = 2, N = 1".

    python -m pipemare.experiments.studies.ablation run --out DIR --tasks char_gpt \\
        --lrs char_gpt=3e-3 --grid 2:1 --seeds 0 1 --variants async+nadam99 async+rate
    python -m pipemare.experiments.studies.ablation table --out DIR --tasks char_gpt \\
        --lrs char_gpt=3e-3 --grid 2:1 2:2 --seeds 0 1 --variants gpipe async pipemare ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipemare.experiments._commands import command_parser
from pipemare.experiments.studies.grid import VARIANTS, Job

__all__ = ["EXTRA", "Extra", "summarise", "table_markdown"]


@dataclasses.dataclass(frozen=True)
class Extra:
    """A variant beyond the grid's: a grid variant with another optimiser or a rate factor.

    Attributes:
        base: the grid variant it starts from (its schedule and corrections).
        beta1: the first-moment decay of the optimiser that replaces the task's Adam(W)
            (its weight decay kept), None: the task's own.
        nesterov: NAdam (Nesterov's look-ahead; torch's ``momentum_decay`` 0.004, AsyncPP's)
            instead of Adam.
        delay_rate: each stage's rate times ``1/(1 + τ_i)``, τ_i its forward delay.
        first_beta1: the momentum of every stage but the last (the default's delay-aware
            momenta at P = 2, N = 1, where the first stage gets 0.99), whatever the delays;
            None: the optimiser's own.
    """

    base: str
    beta1: float | None = None
    nesterov: bool = False
    delay_rate: bool = False
    first_beta1: float | None = None


#: name -> what it changes; the optimiser swaps apply to the tasks trained with Adam or AdamW
EXTRA: dict[str, Extra] = {
    # AsyncPP (Ajanthan et al., ICML 2025): NAdam(W) with β1 = 0.99 on the asynchronous pipeline
    "async+nadam99": Extra("async", beta1=0.99, nesterov=True),
    "pipemare+nadam99": Extra("pipemare", beta1=0.99, nesterov=True),
    # the same optimiser on one device, and β1 = 0.99 without the look-ahead
    "gpipe+nadam99": Extra("gpipe", beta1=0.99, nesterov=True),
    "gpipe+adam99": Extra("gpipe", beta1=0.99),
    "async+adam99": Extra("async", beta1=0.99),
    # the default's momenta at P = 2, N = 1 (0.99 on the first stage, 0.9 on the last) on one
    # device: what the raised momentum costs without any delay
    "gpipe+first99": Extra("gpipe", first_beta1=0.99),
    # the classical rate for a τ-step delay, per stage
    "async+rate": Extra("async", delay_rate=True),
    "pipemare+rate": Extra("pipemare", delay_rate=True),
}


def _swapped_optimizer(extra: Extra, name: str, model: Any, lr: float) -> Any:
    """The task's Adam(W) as ``extra`` changes it."""
    import torch

    if name not in ("adam", "adamw") or extra.beta1 is None:
        raise ValueError(f"{extra} swaps Adam or AdamW, not {name!r}")
    decay = 0.01 if name == "adamw" else 0.0
    betas = (extra.beta1, 0.999)
    if extra.nesterov:
        return torch.optim.NAdam(
            model.parameters(),
            lr=lr,
            betas=betas,
            weight_decay=decay,
            decoupled_weight_decay=name == "adamw",
        )
    kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return kind(model.parameters(), lr=lr, betas=betas, weight_decay=decay)


def _delay_rate() -> Any:
    from pipemare.optim.corrections.base import Correction

    class DelayRate(Correction):
        """Each stage's rate times ``1/(1 + τ_i)``, at every step."""

        name = "delay_rate"

        def lr_factor(self, stage: int, step: int) -> float:
            return 1.0 / (1.0 + self.view.delays[stage].forward)

    return DelayRate()


def _first_momentum(top: float) -> Any:
    from pipemare.optim.corrections.base import Correction

    class FirstMomentum(Correction):
        """Every stage but the last steps with momentum ``top``."""

        name = "first_momentum"

        def momentum(self, stage: int, step: int, momentum: float) -> float:
            return top if stage < len(self.view.delays) - 1 else momentum

    return FirstMomentum()


def _add_correction(pipe: Any, correction: Any) -> None:
    """Run ``correction`` after the pipeline's own (bound as they are)."""
    from pipemare.optim.corrections.base import StageView

    opt = pipe.optimizer
    view = StageView(
        opt.optimizer,
        {s: opt.stage_parameters(s) for s in opt.stages},
        opt.delays,
        pipe.microbatches,
        momentum=opt.momentum,
        strength=None if opt.guard is None else opt.guard.factor,
    )
    correction.bind(view)
    opt.corrections.append(correction)


@contextlib.contextmanager
def _extended(extra: Extra) -> Iterator[None]:
    """The protocol's run, with ``extra``'s optimiser and rate factor (this process only)."""
    from pipemare.experiments.studies import protocol

    build_optimizer, build_pipeline = protocol._optimizer, protocol._pipeline

    def optimizer(name: str, model: Any, lr: float) -> Any:
        if extra.beta1 is None:
            return build_optimizer(name, model, lr)
        return _swapped_optimizer(extra, name, model, lr)

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = build_pipeline(*args, **kwargs)
        if extra.delay_rate:
            _add_correction(pipe, _delay_rate())
        if extra.first_beta1 is not None:
            _add_correction(pipe, _first_momentum(extra.first_beta1))
        return pipe

    protocol._optimizer, protocol._pipeline = optimizer, pipeline
    try:
        yield
    finally:
        protocol._optimizer, protocol._pipeline = build_optimizer, build_pipeline


def _run(job: Job) -> dict[str, Any]:
    import torch

    from pipemare.experiments.studies.protocol import TASKS, run_task

    torch.set_num_threads(1)
    extra = EXTRA[job.variant]
    schedule, config = VARIANTS[extra.base]
    with _extended(extra):
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
    out = dataclasses.asdict(result)
    if out["setup"] is not None:
        out["setup"]["extra"] = dataclasses.asdict(extra)
    return out


def run(jobs: list[Job], out: Path, workers: int) -> None:
    """Train the jobs of :data:`EXTRA` variants not stored under ``out/runs`` yet, ``workers``
    at a time (one: in this process)."""
    todo = [j for j in jobs if not (out / "runs" / f"{j.key}.json").exists()]
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if workers <= 1:  # in this process: no interpreter to start
        import torch

        threads = torch.get_num_threads()
        try:
            for job in todo:
                _store(out, job, _run(job))
        finally:
            torch.set_num_threads(threads)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        for job, result in zip(todo, pool.imap(_run, todo), strict=True):
            _store(out, job, result)


def _store(out: Path, job: Job, result: dict[str, Any]) -> None:
    (out / "runs" / f"{job.key}.json").write_text(json.dumps(result))
    print(f"{job.key}: {result['metric'][-1] if result['metric'] else 'refused'}")


def _final(run: dict[str, Any]) -> float:
    """The validation metric at the run's last step (NaN where it diverged or was refused)."""
    if run.get("refused") or run.get("diverged") or not run["metric"]:
        return math.nan
    return float(run["metric"][-1])


def summarise(out: Path, jobs: list[Job]) -> list[dict[str, Any]]:
    """Per job stored under ``out/runs``: its final and best metric and curve, compactly."""
    rows = []
    for job in jobs:
        path = out / "runs" / f"{job.key}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        setup = r.get("setup") or {}
        rows.append(
            {
                **dataclasses.asdict(job),
                "final": _final(r),
                "diverged": bool(r.get("diverged")),
                "steps_run": r["steps"][-1] if r["steps"] else 0,
                "curve": [r["steps"], [round(m, 5) for m in r["metric"]]],
                "corrections": setup.get("corrections", setup.get("refused")),
                "extra": setup.get("extra"),
            }
        )
    return rows


def _cell(values: list[float]) -> tuple[float, float, str]:
    """Mean, half-range and the cell's text ('—' without values, 'diverged' with a NaN)."""
    if not values:
        return math.nan, math.nan, "—"
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan, "diverged"
    mean, half = statistics.fmean(values), (max(values) - min(values)) / 2
    return mean, half, f"{mean:.3f} ± {half:.3f}"


def _gap(value: float, ref: float, higher: bool) -> str:
    if math.isnan(value) or math.isnan(ref):
        return ""
    if higher:
        return f"{100 * (value - ref):+.1f} pt"
    return f"{100 * (value - ref) / ref:+.1f}%"


def _values(rows: list[dict[str, Any]], variant: str, p: int, n: int) -> list[float]:
    """The final metrics of ``variant`` at P:N (one device's, gpipe's, at every layout)."""
    sync = variant.startswith("gpipe")
    return [
        r["final"]
        for r in rows
        if r["variant"] == variant and (sync or (r["stages"], r["microbatches"]) == (p, n))
    ]


def table_markdown(
    rows: list[dict[str, Any]], tasks: list[str], grid: list[tuple[int, int]], variants: list[str]
) -> str:
    """One table per task: each variant's final quality per (P, N), its gap to gpipe and to
    async (mean ± half-range over the seeds stored)."""
    from pipemare.experiments.studies.protocol import TASKS

    lines = []
    for task in tasks:
        higher = TASKS[task].higher_is_better
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        lr = mine[0]["lr"]
        what = "accuracy" if higher else "validation loss"
        steps = max(r["steps_run"] for r in mine)
        lines += [f"### {task}: final {what} at {steps} steps, lr {lr:g}", ""]
        head = "| variant |" + "".join(f" P:N {p}:{n} | vs gpipe | vs async |" for p, n in grid)
        lines += [head, "|---|" + "---|---|---|" * len(grid)]

        for variant in variants:
            cells = []
            for p, n in grid:
                mean, _, text = _cell(_values(mine, variant, p, n))
                gpipe = _cell(_values(mine, "gpipe", p, n))[0]
                base = _cell(_values(mine, "async", p, n))[0]
                vs = f"{_gap(mean, gpipe, higher)} | {_gap(mean, base, higher)}"
                cells.append(f" {text} | {vs} |")
            lines.append(f"| {variant} |" + "".join(cells))
        lines.append("")
    return "\n".join(lines)


def _jobs(args: Any) -> list[Job]:
    lrs = dict(item.split("=") for item in args.lrs)
    grid = [tuple(int(x) for x in g.split(":")) for g in args.grid]
    return [
        Job(t, v, p, n, float(lrs[t]), s, args.steps)
        for t in args.tasks
        for v in args.variants
        for p, n in ([grid[0]] if v.startswith("gpipe") else grid)
        for s in args.seeds
    ]


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ablation", __doc__)
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--lrs", nargs="+", required=True, help="TASK=LR, the rate per task")
    parser.add_argument("--grid", nargs="+", default=["2:1"], help="P:N pairs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--steps", type=int, help="steps per run (default: the task's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--summary", type=Path, help="also write the table and runs here")
    args = parser.parse_args(argv)
    jobs = _jobs(args)
    if args.what == "run":
        unknown = sorted({j.variant for j in jobs} - set(EXTRA))
        if unknown:
            parser.error(f"run trains {sorted(EXTRA)} only; the others: pipemare protocol")
        run(jobs, args.out, args.workers)
        return
    rows = summarise(args.out, jobs)
    grid = [tuple(int(x) for x in g.split(":")) for g in args.grid]
    text = table_markdown(rows, args.tasks, grid, args.variants)  # type: ignore[arg-type]
    print(text)
    if args.summary:
        args.summary.mkdir(parents=True, exist_ok=True)
        (args.summary / "table.md").write_text(text)
        (args.summary / "runs.json").write_text(json.dumps(rows, indent=0))
    missing = len(jobs) - len(rows)
    if missing:
        print(f"{missing} of {len(jobs)} runs not stored yet", file=sys.stderr)


if __name__ == "__main__":
    main()
