"""A user's GPT run, launched by the tests in a subprocess: the byte-level GPT written as people
write one (tests/support/gpt.py: blocks in a ModuleList, the head tied to the token
embedding) on Python's standard-library source, AdamW at the rate tuned on one device, on one
device (Lightning's own strategy) or through ``Trainer(strategy="pipemare", devices=2)`` with
nothing else set. Rank 0 writes the final validation loss and the layout the strategy chose."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pytorch_lightning as pl
import torch

import pipemare  # noqa: F401  (importing it registers strategy="pipemare" with Lightning)
from support.data import CharCorpusDataModule
from support.gpt import CharGPT

#: the rate tuned on one device for this GPT and run length (tests/lightning/
#: test_gpt_quality.py's docstring has the sweep)
RATE = 1e-2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--lr", type=float, default=RATE)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = CharGPT(
        d_model=64,
        heads=4,
        layers=4,
        context=32,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01),
    )
    data = CharCorpusDataModule(context=32, batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="pipemare" if args.devices > 1 else "auto",
        max_steps=args.steps,
        val_check_interval=args.steps,  # one validation, after the last step
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        report = {
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "global_step": trainer.global_step,
            "stages": len(getattr(strategy, "delays", [None])),
            "microbatches": getattr(strategy, "microbatches", 1),
        }
        (args.out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
