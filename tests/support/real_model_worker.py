"""One process of a 2-process run of a model as people write it (support/real_modules.py: the
tied GPT, Hugging Face GPT-2, a resnet18) through
Trainer(strategy=PipeMareStrategy(...), devices=2) over gloo, nothing named; started by
Lightning's launcher. Every rank writes its final weights and validation loss; rank 0 also a
checkpoint. ``--models`` trains several in turn in one launch (the tests share it)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from pipemare import PipeMareStrategy
from support.models import quiet_trainer
from support.real_modules import SETUPS
from support.zoo import MetaZoo
from support.zoo import data as zoo_data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--models", nargs="+", default=["gpt"], choices=sorted(SETUPS))
    parser.add_argument("--stages-from", help="a save_pretrained directory of BIG_GEMMA")
    args = parser.parse_args()
    if args.stages_from:  # first: its peak growth is measured from this process's start
        out = Path(args.out) / "big-gemma-stages"
        out.mkdir(parents=True, exist_ok=True)
        read_per_stage(args.stages_from, out)
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


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (``VmRSS``: resident now; ``VmHWM``: its peak), in MB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def _peak_from_now() -> float:
    """Reset this process's peak resident memory to what it holds now (Linux: ``5`` into
    /proc/self/clear_refs), so that the imports' own peak does not hide the run's; return it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def read_per_stage(saved: str, out: Path) -> None:
    """BIG_GEMMA built in configure_model on the meta device, cut right after its embedding,
    each stage read from the shards in ``saved``; gpipe, 4 steps. Every rank reports its
    validation loss, its peak resident growth from here, and the weights it holds."""
    data = zoo_data("causal", n=32)
    start = _peak_from_now()
    module = MetaZoo("big-gemma")
    strategy = PipeMareStrategy(
        microbatches=2, schedule="gpipe", weights=saved, split_points=["model.model.layers.0"]
    )
    trainer = quiet_trainer(strategy, devices=2, max_steps=4, use_distributed_sampler=False)
    trainer.fit(module, data)
    (val,) = trainer.validate(module, data, verbose=False)
    real = [p for p in module.parameters() if not p.is_meta]
    report = {
        "val_loss": val["val_loss"],
        "growth_mb": _status_mb("VmHWM") - start,
        "held_mb": sum(p.numel() * p.element_size() for p in real) / 2**20,
    }
    (out / f"report-{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
