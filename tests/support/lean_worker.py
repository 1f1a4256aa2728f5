"""A rank of a two-process run of a GPT built in ``configure_model``: stage 0 the embedding
alone, stage 1 every block and the head, weights read from a file. Writes its peak resident
growth from its start (after the imports and the data) to its exit, and its stage's bytes."""

from __future__ import annotations

import argparse
import json
import resource
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.experiments.bench.lean import LeanGPT, byte_loaders


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SgdGPT(LeanGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train, val = byte_loaders(context=8, batch=2, rows=8)
    start = _peak_mb()
    module = SgdGPT(args.width, args.blocks)
    strategy = PipeMareStrategy(balance=[1, args.blocks + 1], weights=args.weights)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train, val)
    decisions = [str(d) for d in strategy.settings.decisions] if strategy.settings else []
    trainer.validate(module, val, verbose=False)
    trainer.test(module, val, verbose=False)
    real = [p for p in module.parameters() if not p.is_meta]
    with warnings.catch_warnings(record=True) as caught:  # torch.save would write it empty
        warnings.simplefilter("always")
        module.state_dict()
    report = {
        "growth_mb": _peak_mb() - start,
        "held_mb": sum(p.numel() * p.element_size() for p in real) / 2**20,
        "decisions": decisions,
        "test_loss": float(trainer.callback_metrics["test_loss"]),
        "state_dict_warnings": [str(w.message) for w in caught],
    }
    Path(args.out, f"lean-rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
