"""A user's GPT run: the byte-level GPT written as people write one (tests/support/gpt.py:
blocks in a ModuleList, the head tied to the token embedding) on Python's standard-library
source, AdamW at the rate tuned on one device, on one device (Lightning's own strategy; a test
runs ``main(argv)`` in its own process) or through ``Trainer(strategy="pipemare", devices=2)``
with nothing else set (launched in a subprocess). Rank 0 writes the final validation loss and
the layout the strategy chose."""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

import pipemare  # importing it registers strategy="pipemare" with Lightning
from support.data import CharCorpusDataModule
from support.gpt import CharGPT

#: the rate tuned on one device for this GPT and run length (tests/lightning/
#: test_gpt_quality.py's docstring has the sweep)
RATE = 1e-2


class RecipeGPT(CharGPT):
    """The GPT trained as nanoGPT trains one: AdamW with betas 0.9/0.95 and weight decay 0.1,
    the rate rising linearly over the first tenth of the run, then decaying along a cosine to
    0 at its last step (a LambdaLR stepped every step, as Lightning users write it)."""

    def __init__(self, lr: float, steps: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lr, self.steps = lr, steps

    def configure_optimizers(self) -> Any:
        adamw = torch.optim.AdamW(
            self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1
        )
        warm = max(1, self.steps // 10)

        def factor(k: int) -> float:
            if k < warm:
                return (k + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (k - warm) / (self.steps - warm))))

        rates = torch.optim.lr_scheduler.LambdaLR(adamw, factor)
        return {"optimizer": adamw, "lr_scheduler": {"scheduler": rates, "interval": "step"}}


def _strategy(devices: int, microbatches: int | None) -> Any:
    if devices == 1:
        return "auto"
    if microbatches is None:
        return "pipemare"  # nothing else set, as the user writes it
    return pipemare.PipeMareStrategy(microbatches=microbatches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--lr", type=float, default=RATE)
    parser.add_argument(
        "--recipes",
        nargs="+",
        choices=("constant", "nanogpt"),
        default=["constant"],
        help="each trained in turn in this launch: AdamW at a constant rate, or nanoGPT's "
        "warm-up and cosine; each writes report-RECIPE.json",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--microbatches", type=int, help="N (default: the strategy's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as every launched process runs (OMP_NUM_THREADS=1), or a test's
    for recipe in args.recipes:
        train(args, recipe)


def train(args: argparse.Namespace, recipe: str) -> None:
    pl.seed_everything(args.seed, verbose=False)
    sizes: dict[str, Any] = dict(d_model=64, heads=4, layers=4, context=32)
    if recipe == "nanogpt":
        model: CharGPT = RecipeGPT(args.lr, args.steps, **sizes)
    else:
        adamw = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
        model = CharGPT(**sizes, optimizer=adamw)
    data = CharCorpusDataModule(context=32, batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(args.devices, args.microbatches),
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
            "balance": getattr(strategy, "balance", None),
        }
        (args.out / f"report-{recipe}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
