"""One process of a 2-process run of a model as people write it (support/real_modules.py: the
tied GPT, Hugging Face GPT-2 or Llama, a resnet18) through
Trainer(strategy=PipeMareStrategy(...), devices=2) over gloo, nothing named; started by
Lightning's launcher. Every rank writes its final weights and validation loss; rank 0 also a
checkpoint. ``--models`` trains several in turn in one launch (the tests share it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipemare import PipeMareStrategy
from support.models import quiet_trainer
from support.real_modules import SETUPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--models", nargs="+", default=["gpt"], choices=sorted(SETUPS))
    args = parser.parse_args()
    for name in args.models:  # one launch for them all, each into a folder of its own
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        train(name, args.schedule, out)


def train(name: str, schedule: str, out: Path) -> None:
    build, data, microbatches, steps = SETUPS[name]
    strategy = PipeMareStrategy(microbatches=microbatches, schedule=schedule)
    # the loader as it is, so that one device sees the same batches (Lightning's distributed
    # sampler would shuffle them)
    trainer = quiet_trainer(strategy, devices=2, max_steps=steps, use_distributed_sampler=False)
    model = build()
    trainer.fit(model, data())
    rank = trainer.global_rank
    (val,) = trainer.validate(model, data(), verbose=False)
    trainer.save_checkpoint(out / "model.ckpt")  # every rank takes part; rank 0 writes
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / f"weights-{rank}.pt")
    report = {
        "val_loss": val["val_loss"],
        "balance": list(strategy.balance),
        "rank": rank,
        "global_step": trainer.global_step,
    }
    (out / f"report-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
