"""What pipemare's monitors cost: training step time with and without them, in one process.

``python -m pipemare.experiments.bench.monitors`` trains the same model through the same
simulated pipeline with no callbacks and with the three monitors at their default settings (a
CSV logger in both), each run in a fresh process, alternating for several rounds so that drift
on a shared machine hits both alike, and reports the median of the runs' median step times.
Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipemare import PipeMareStrategy
from pipemare.callbacks import monitors
from pipemare.experiments.bench.launch import add_model_options
from pipemare.experiments.bench.memory import mlp


class _Module(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = mlp(width, depth)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def median_step_seconds(monitored: bool, args: argparse.Namespace, logdir: str) -> float:
    pl.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.batch * args.steps, args.width, generator=gen),
        torch.randint(0, 10, (args.batch * args.steps,), generator=gen),
    )
    timer = _StepTimer()
    callbacks = [*monitors(), timer] if monitored else [timer]
    trainer = pl.Trainer(
        strategy=PipeMareStrategy(
            stages=args.stages, microbatches=args.microbatches, balance="params"
        ),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=pl.loggers.CSVLogger(logdir),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=50,
    )
    trainer.fit(_Module(args.width, args.depth), DataLoader(data, batch_size=args.batch))
    return statistics.median(timer.times[10:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_options(parser, width=512, depth=16, batch=64)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--one", choices=["plain", "monitored"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.one is not None:  # a single run, in a process of its own
        with tempfile.TemporaryDirectory() as logdir:
            print(
                json.dumps({"step_s": median_step_seconds(args.one == "monitored", args, logdir)})
            )
        return
    times: dict[str, list[float]] = {"plain": [], "monitored": []}
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("one", "rounds")]
    for r in range(args.rounds):
        for which in ("plain", "monitored") if r % 2 == 0 else ("monitored", "plain"):
            cmd = [
                sys.executable,
                "-m",
                "pipemare.experiments.bench.monitors",
                *flags,
                f"--one={which}",
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            times[which].append(json.loads(out.strip().splitlines()[-1])["step_s"])
    base, mon = statistics.median(times["plain"]), statistics.median(times["monitored"])
    print(
        json.dumps(
            {
                "benchmark": "monitors",
                "stages": args.stages,
                "width": args.width,
                "depth": args.depth,
                "batch": args.batch,
                "microbatches": args.microbatches,
                "rounds": args.rounds,
                "step_ms": 1e3 * base,
                "monitored_step_ms": 1e3 * mon,
                "overhead": mon / base - 1,
            }
        )
    )


if __name__ == "__main__":
    main()
