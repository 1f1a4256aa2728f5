"""Runs for the checkpoint tests: the same training with and without checkpoints, killed and
resumed mid-epoch, or drained at one step (what a resume from that step promises); under
torchrun with restarts, killed once after its first checkpoint and resumed by
``fit(ckpt_path="last")`` in the restarted processes.

Every run trains the same small model (BatchNorm and dropout, so buffers and random streams
matter) on a shuffled resumable DataLoader and writes its final weights and, per step, the
indices of the samples it trained on (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import pipemare


class Indexed(Dataset):
    def __init__(self, n: int = 96) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 5, generator=gen)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Dropout(0.2),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 3),
        )
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[2].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Act(pl.Callback):
    """Drain the pipeline, or SIGKILL this process, right after a given step, or (in torchrun's
    first attempt only) ``kill_after_save`` steps after ``last.ckpt`` appeared on disk."""

    def __init__(
        self,
        drain_at: int | None,
        kill_at: int | None,
        kill_rank: int,
        out: Path,
        kill_after_save: int | None = None,
    ) -> None:
        self.drain_at, self.kill_at, self.kill_rank = drain_at, kill_at, kill_rank
        self.out, self.kill_after_save = out, kill_after_save
        self.saved_at: int | None = None  # the step at whose end last.ckpt was first seen

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:  # where each attempt started (a resume: the checkpoint)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "none")
            self.out.mkdir(parents=True, exist_ok=True)
            path = trainer.ckpt_path
            record = {"global_step": trainer.global_step, "ckpt_path": path and str(path)}
            (self.out / f"attempt-{attempt}.json").write_text(json.dumps(record))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.drain_at:
            trainer.strategy.pipeline.drain()
            if trainer.world_size == 1:  # the drained state, to compare a checkpoint with
                self.out.mkdir(parents=True, exist_ok=True)
                state = {
                    "state_dict": pl_module.state_dict(),
                    "optimizer": trainer.optimizers[0].state_dict(),
                }
                torch.save(state, self.out / "drained.pt")
        if trainer.global_step == self.kill_at and trainer.global_rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._first_attempt(trainer) and self.kill_after_save is not None:
            if self.saved_at is None and (self.out / "ckpt" / "last.ckpt").exists():
                self.saved_at = trainer.global_step  # complete: the file is renamed into place
            if self.saved_at is not None and trainer.global_step >= (
                self.saved_at + self.kill_after_save
            ):
                os.kill(os.getpid(), signal.SIGKILL)

    def _first_attempt(self, trainer) -> bool:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        return restarts == "0" and trainer.global_rank == self.kill_rank


def run(
    out: Path,
    devices: int = 1,
    stages: int = 4,
    steps: int = 30,
    every: int = 0,
    drain_at: int | None = None,
    kill_at: int | None = None,
    kill_rank: int = 0,
    kill_after_save: int | None = None,
    resume: Path | str | None = None,
    sharded: bool | None = None,
    schedule: str = "pipemare",
) -> pl.Trainer:
    """Train; write ``final.pt`` (weights) and ``seen.json`` (sample indices per step)."""
    pl.seed_everything(0)
    model = Model()
    data = Indexed()
    # the sampler owns its generator: StatefulDataLoader's generator also seeds each epoch's
    # workers, which would make the shuffle of the epochs after a resume differ
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(1))
    loader = StatefulDataLoader(data, batch_size=12, sampler=sampler)
    callbacks: list[pl.Callback] = [Act(drain_at, kill_at, kill_rank, out, kill_after_save)]
    if every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=out / "ckpt",
                every_n_train_steps=every,
                save_top_k=-1,
                save_last=True,
                filename="{step}",
            )
        )
    trainer = pl.Trainer(
        strategy=pipemare.PipeMareStrategy(
            stages=stages if devices == 1 else None,
            microbatches=2,
            schedule=schedule,
            balance="even",
            save_distributed_checkpoint=sharded,
            stall_timeout=60,  # generous: a busy machine must not look like a stall
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        # the sampler is seeded alike on every rank; Lightning's one-replica DistributedSampler
        # would order the data otherwise than the one-process run compared with
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=bool(every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, loader, ckpt_path=resume)
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "final.pt")
        first = trainer.global_step - len(model.seen)
        (out / "seen.json").write_text(json.dumps({"first": first, "seen": model.seen}))
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=0, help="checkpoint every k steps")
    parser.add_argument("--drain-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument(
        "--kill-after-save",
        type=int,
        help="in torchrun's first attempt, kill --kill-rank this many steps after last.ckpt exists",
    )
    parser.add_argument("--resume", help='a checkpoint, or "last" (the newest last.ckpt, if any)')
    parser.add_argument(
        "--sharded", action="store_const", const=True, help="per-stage checkpoint directories"
    )
    parser.add_argument("--schedule", default="pipemare")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(**{k.replace("-", "_"): v for k, v in vars(args).items()})


if __name__ == "__main__":
    main()
