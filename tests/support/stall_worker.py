"""A Lightning run over 2 processes for the failure tests. Every rank writes its PID at the
start; rank 1, at step 5, writes "ready" and then, by ``--mode``:

- ``signal``: trains on; the test kills or stops it by PID;
- ``native``: calls libc's ``sleep`` through ``ctypes.PyDLL`` (which keeps the interpreter
  lock), as a native call that hangs would: its heartbeat stops with it;
- ``slow``: one forward takes ``--slow`` seconds (a Python sleep, as a long kernel would: the
  lock is free), longer than ``heartbeat_timeout``; the run must end normally;
- ``raise``: raises an error of its own, then takes ``--slow`` seconds to finalise its logger
  (as a slow upload would), longer than ``heartbeat_timeout``.

``stall_timeout`` is left at its default unless given.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipemare
from support.models import quiet_trainer


class Slow(nn.Module):
    """Identity, but its forward sleeps once, at a given call on rank 1."""

    def __init__(self, at_call: int, seconds: float) -> None:
        super().__init__()
        self.at_call, self.seconds, self.calls = at_call, seconds, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call and self.seconds:
            time.sleep(self.seconds)
        return x


class Small(pl.LightningModule):
    def __init__(self, slow: float) -> None:
        super().__init__()
        # with balance="even" over 2 stages, Slow is the first layer of stage 1
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), Slow(3, slow), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all: the test polls for the file and reads it at once
    (it once read a file created but not yet written)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


class Pids(pl.Callback):
    def __init__(self, out: Path, mode: str) -> None:
        self.out, self.mode = out, mode

    def on_train_start(self, trainer, pl_module):
        _write(self.out / f"pid-rank{trainer.global_rank}", str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 5:
            _write(self.out / "ready", str(os.getpid()))
            if self.mode == "native":
                ctypes.PyDLL(None).sleep(600)  # holds the interpreter lock throughout
            if self.mode == "raise":
                raise RuntimeError("boom at step 5")


class SlowToFinalise(pl.loggers.Logger):
    """A logger whose finalising after a failure takes ``seconds`` on rank 1 (Lightning calls
    it after the strategy's ``on_exception``)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    name, version = "slow", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def finalize(self, status: str) -> None:
        if status == "failed" and int(os.environ.get("LOCAL_RANK", "0")) == 1:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["signal", "native", "slow", "raise"], default="signal")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--max-steps", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    x = torch.randn(4096, 8)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = quiet_trainer(
        pipemare.PipeMareStrategy(heartbeat_timeout=args.heartbeat_timeout, balance="even"),
        devices=2,
        max_epochs=1000,
        max_steps=args.max_steps,
        callbacks=[Pids(args.out, args.mode)],
        logger=SlowToFinalise(args.slow) if args.mode == "raise" else False,
    )
    trainer.fit(Small(args.slow if args.mode == "slow" else 0.0), data)
    (args.out / f"finished-rank{trainer.global_rank}").write_text("1")


if __name__ == "__main__":
    main()
