"""One process of a 2-process run of the tied GPT (tests/_gpt_module.py) through
Trainer(strategy=PipeMareStrategy(...), devices=2) over gloo; started by Lightning's launcher.
Every rank writes its final weights and validation loss; rank 0 also a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _gpt_module import GPTModule, tokens
from _models import quiet_trainer

from pipemare import PipeMareStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--untied", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    strategy = PipeMareStrategy(microbatches=4, schedule=args.schedule)
    # the loader as it is, so that one device sees the same batches (Lightning's distributed
    # sampler would shuffle them)
    trainer = quiet_trainer(
        strategy, devices=2, max_steps=args.steps, use_distributed_sampler=False
    )
    model = GPTModule(tied=not args.untied)
    trainer.fit(model, tokens())
    rank = trainer.global_rank
    train_loss = float(trainer.callback_metrics["train_loss"])
    (val,) = trainer.validate(model, tokens(), verbose=False)
    trainer.save_checkpoint(out / "gpt.ckpt")  # every rank takes part; rank 0 writes
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / f"weights-{rank}.pt")
    report = {
        "val_loss": val["val_loss"],
        "train_loss": train_loss,
        "balance": list(strategy.balance),
        "rank": rank,
    }
    (out / f"report-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
