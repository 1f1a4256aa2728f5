"""A small GPT built in ``configure_model`` (each process makes only its own stage real), trained
with AdamW and per-stage checkpoints, or resumed from one; for the per-stage checkpoint tests.

Writes ``final.pt`` (the whole model's weights after fit, gathered on rank 0),
``val_loss.json`` (the pipelined validation loss after fit) and, with
``--record-reads``, every key each rank read from a per-stage checkpoint
(``reads-rank{R}.json``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.experiments.bench.lean import LeanGPT, byte_loaders

WIDTH, BLOCKS = 32, 2  # 4 layers: the embedding, 2 blocks, the head (tied to the embedding)


def run(
    out: Path,
    devices: int,
    stages: int,
    steps: int,
    every: int = 0,
    resume: str | None = None,
    sharded: bool | None = None,
    schedule: str = "pipemare",
) -> pl.Trainer:
    pl.seed_everything(0)
    train, val = byte_loaders(context=8, batch=4, rows=4 * 12)
    callbacks: list[pl.Callback] = []
    if every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1, filename="{step}"
            )
        )
    module = LeanGPT(WIDTH, BLOCKS, heads=2, lr=1e-2)
    strategy = PipeMareStrategy(
        stages=stages,
        microbatches=2,
        schedule=schedule,
        balance=[1, 1, 1, 1] if stages == 4 else [2, 2],
        save_distributed_checkpoint=sharded,
        advise=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(module, train, ckpt_path=resume)
    (metrics,) = trainer.validate(module, val, verbose=False)
    trainer.strategy.gather()
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(module.state_dict(), out / "final.pt")
        (out / "val_loss.json").write_text(json.dumps(metrics["val_loss"]))
    return trainer


def _record_reads(out: Path) -> None:
    from pipemare.lightning import shards

    read = shards.ShardedCheckpoint.read

    def recorded(self, keys):
        keys = list(keys)
        path = out / f"reads-rank{os.environ.get('LOCAL_RANK', '0')}.json"
        out.mkdir(parents=True, exist_ok=True)
        before = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(before + keys))
        return read(self, keys)

    shards.ShardedCheckpoint.read = recorded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--schedule", default="pipemare")
    parser.add_argument("--record-reads", action="store_true")
    parser.add_argument("--sharded", action="store_const", const=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.record_reads:
        _record_reads(args.out)
    run(args.out, args.devices, args.stages, args.steps, args.every, args.resume,
        sharded=args.sharded, schedule=args.schedule)  # fmt: skip


if __name__ == "__main__":
    main()
