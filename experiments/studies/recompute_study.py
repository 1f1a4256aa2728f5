"""Activation recomputation's effect on quality and on the memory each stage holds.

Trains the residual MLP on sklearn's digits through the simulator (all stages in this process,
the staleness of one process per stage) with the non-flushing schedules, once keeping
activations (the default) and once recomputing them (``recompute=True``), for a few seeds.
Under ``async`` and ``pipemare`` the rerun sees backward-time weights, so the two differ in
what they compute, not only in memory; GPipe is the synchronous reference.

Writes ``results.md`` and ``results.json`` to ``--out``: best and final validation accuracy
per configuration (mean and spread over seeds), wall time, and each stage's measured peak of
bytes held for in-flight microbatches (``Stage.peak_saved_bytes``) with and without.

Run: ``python -m pipemare.experiments.studies.recompute_study`` (about three minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipemare import Pipeline
from pipemare.experiments._commands import command_parser
from pipemare.experiments.tasks.data import digits
from pipemare.experiments.tasks.models import residual_mlp

__all__ = ["main", "train_and_measure"]


def train_and_measure(
    schedule: str, recompute: bool, microbatches: int, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run; returns its validation accuracies per epoch and each stage's memory figures."""
    x_train, y_train, x_val, y_val = digits()
    torch.manual_seed(seed)
    model = residual_mlp(x_train.shape[1], 10)
    pipe = Pipeline(
        model,
        torch.optim.Adam(model.parameters(), lr=args.lr),
        nn.functional.cross_entropy,
        stages=args.stages,
        microbatches=microbatches,
        schedule=schedule,
        seed=seed,
        recompute=recompute,
    )
    for stage in pipe.stages:  # GPipe's stages count only when asked (a hook per saved tensor)
        stage.measure_saved = True
    gen = torch.Generator().manual_seed(seed)
    accuracies, start = [], time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i : i + args.batch_size]
            pipe.step((x_train[idx], y_train[idx]))
        predictions = pipe.predict(x_val).argmax(1)  # drains first, like validation
        accuracies.append(float((predictions == y_val).float().mean()))
    return {
        "schedule": schedule,
        "recompute": recompute,
        "microbatches": microbatches,
        "seed": seed,
        "val_acc": accuracies,
        "best": max(accuracies),
        "final": accuracies[-1],
        "seconds": time.perf_counter() - start,
        "peak_in_flight": [s.peak_in_flight for s in pipe.stages],
        "peak_saved_bytes": [s.peak_saved_bytes for s in pipe.stages],
    }


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    half = (max(values) - min(values)) / 2
    return f"{mean:.3f} ± {half:.3f}"


def _configs(args: argparse.Namespace) -> list[tuple[str, bool, int]]:
    configs = [("gpipe", False, 1)]
    for n in args.microbatches:
        for schedule in args.schedules:
            configs += [(schedule, False, n), (schedule, True, n)]
    return configs


def _quality_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        "| schedule | N | recompute | best val acc | final val acc | per seed (best) | s/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, recompute, n in _configs(args):
        group = [
            r
            for r in runs
            if (r["schedule"], r["recompute"], r["microbatches"]) == (schedule, recompute, n)
        ]
        best = [r["best"] for r in group]
        final = [r["final"] for r in group]
        seconds = statistics.fmean(r["seconds"] for r in group)
        seeds = ", ".join(f"{b:.3f}" for b in best)
        lines.append(
            f"| {schedule} | {n} | {recompute} | {_spread(best)} | {_spread(final)} | {seeds} "
            f"| {seconds:.1f} |"
        )
    return lines


def _memory_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    first = min(r["seed"] for r in runs)
    for n in args.microbatches:
        schedule = args.schedules[0]
        pick = {
            r["recompute"]: r
            for r in runs
            if r["seed"] == first and r["schedule"] == schedule and r["microbatches"] == n
        }
        plain, rerun = pick[False], pick[True]
        lines += [
            "",
            f"Peak bytes held for in-flight microbatches, `{schedule}`, N={n} "
            f"(microbatch {args.batch_size // n} rows), seed {first}:",
            "",
            "| stage | peak in flight | default | per microbatch | recompute | per microbatch "
            "| recompute / default |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, (a, b) in enumerate(
            zip(plain["peak_saved_bytes"], rerun["peak_saved_bytes"], strict=True)
        ):
            k = plain["peak_in_flight"][i]
            ratio = b / a if a else float("nan")
            lines.append(
                f"| {i} | {k} | {a:,} | {a / k:,.0f} | {b:,} | {b / k:,.0f} | {ratio:.2f} |"
            )
        total_a, total_b = sum(plain["peak_saved_bytes"]), sum(rerun["peak_saved_bytes"])
        lines.append(f"| all | | {total_a:,} | | {total_b:,} | | {total_b / total_a:.2f} |")
    lines += [
        "",
        "Stage i of a non-flushing schedule holds P−i microbatches at its peak (any N). Default: "
        "what autograd saved (parameters excluded), the input leaves and the outputs; "
        "recompute: the inputs only (the last stage never reruns). Each storage counts once: "
        "at N>1 stage 0's microbatches are slices of their minibatch, so it holds whole "
        "minibatches (its per-microbatch figure is not one microbatch's bytes). The rerun "
        "adds one microbatch's activations for the duration of a backward, not counted here.",
    ]
    return lines


def report(runs: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    """The study's results as markdown."""
    head = [
        "# Activation recomputation: quality and memory",
        "",
        f"Command: `{command}`",
        "",
        f"sklearn digits (1497 train / 300 validation), residual MLP, {args.stages} stages in "
        f"one process, Adam lr={args.lr}, batch {args.batch_size}, {args.epochs} epochs, "
        f"seeds {', '.join(map(str, args.seeds))}; validation after every epoch (drained). "
        "Accuracy: mean ± half the range over seeds. Wall seconds come from a shared two-core "
        "machine with other jobs running: indicative only.",
        "",
    ]
    return "\n".join(head + _quality_table(runs, args) + _memory_table(runs, args)) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = command_parser("python -m pipemare.experiments.studies.recompute_study", __doc__)
    parser.add_argument("--schedules", nargs="+", default=["async", "pipemare"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/recompute"))
    parser.add_argument(
        "--render", action="store_true", help="rewrite results.md from results.json; no training"
    )
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads((args.out / "results.json").read_text())
        settings = argparse.Namespace(**{**saved["settings"], "out": args.out})
        (args.out / "results.md").write_text(report(saved["runs"], settings, saved["command"]))
        return list(saved["runs"])
    command = shlex.join(
        ["python", "-m", "pipemare.experiments.studies.recompute_study", *(argv or sys.argv[1:])]
    )
    torch.set_num_threads(1)
    runs = []
    for schedule, recompute, n in _configs(args):
        for seed in args.seeds:
            run = train_and_measure(schedule, recompute, n, seed, args)
            runs.append(run)
            print(
                f"{schedule:<9} N={n} recompute={recompute!s:<5} seed={seed} "
                f"best={run['best']:.3f} final={run['final']:.3f} {run['seconds']:.1f}s",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(report(runs, args, command))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "results.json").write_text(
        json.dumps({"command": command, "settings": settings, "runs": runs}, indent=1) + "\n"
    )
    return runs


if __name__ == "__main__":
    main()
