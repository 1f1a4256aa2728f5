"""Engine demo: 8 fine-grained stages in one process, on real digits, across schedules.

``pipemare demo`` trains the same residual MLP with each schedule through the simulator (the
same staleness as one process per stage) and prints test accuracy (the mean over the last
five epochs, each evaluated after draining the pipeline), the training loss of the last tenth,
the stage-0 delay and the weight copies PipeDream's stashing needed.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pipemare import Pipeline
from pipemare.experiments._commands import command_parser
from pipemare.experiments.tasks.data import digits
from pipemare.experiments.tasks.models import residual_mlp
from pipemare.schedule.actions import SCHEDULES


def train_digits(schedule: str, args: argparse.Namespace) -> dict:
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(args.seed)
    model = residual_mlp(x_train.shape[1], 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    pipe = Pipeline(
        model,
        optimizer,
        nn.functional.cross_entropy,
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=schedule,
    )
    gen = torch.Generator().manual_seed(args.seed)
    losses, accuracies, start = [], [], time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i : i + args.batch_size]
            losses.append(float(pipe.step((x_train[idx], y_train[idx]))))
        if epoch >= args.epochs - 5:
            predictions = pipe.predict(x_test).argmax(1)  # drains first, like validation
            accuracies.append(float((predictions == y_test).float().mean()))
    seconds = time.perf_counter() - start
    tail = losses[-len(losses) // 10 :]
    return {
        "schedule": schedule,
        "test_acc": sum(accuracies) / len(accuracies),
        "train_loss": sum(tail) / len(tail),
        "stage0_delay": pipe.delays[0].forward,
        "stashed_versions": max(s.peak_stashed_versions for s in pipe.stages),
        "seconds": seconds,
    }


def _positive(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("pipemare demo", __doc__)
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "pipedream", "async", "pipemare"],
        choices=SCHEDULES,
    )
    parser.add_argument("--stages", type=_positive, default=8)
    parser.add_argument("--microbatches", type=_positive, default=1)
    parser.add_argument("--epochs", type=_positive, default=20)
    parser.add_argument("--batch-size", type=_positive, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layers = len(residual_mlp(64, 10))  # digits: 64 features, 10 classes
    if args.stages > layers:
        parser.error(
            f"--stages {args.stages}: the demo's model has {layers} layers, at most one stage each"
        )
    if args.microbatches > args.batch_size:
        parser.error(
            f"--microbatches {args.microbatches} exceeds --batch-size {args.batch_size}; "
            "every microbatch needs at least one sample"
        )
    torch.set_num_threads(1)
    print(
        f"digits (sklearn, 1497 train / 300 test), residual MLP, {args.stages} stages in one "
        f"process, N={args.microbatches}, Adam lr={args.lr}, {args.epochs} epochs"
    )
    print(f"{'schedule':<10} {'test acc':>8} {'loss':>8} {'tau_0':>6} {'copies':>6} {'sec':>6}")
    rows = []
    for schedule in args.schedules:
        r = train_digits(schedule, args)
        rows.append(r)
        print(
            f"{r['schedule']:<10} {r['test_acc']:>8.3f} {r['train_loss']:>8.4f} "
            f"{r['stage0_delay']:>6.1f} {r['stashed_versions']:>6d} {r['seconds']:>6.1f}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
