"""The zoo's GPT-2 (``GPT2Config()`` sizes shrunk, dropout as shipped) at P = 2 over eight seeds:
the measurement behind docs/results.md, "A Hugging Face GPT-2 as its config ships it".

    python tests/support/gpt2_seeds.py one,gpipe,default,async,t2,n4,no_wp,no_spike,no_dm
    python tests/support/gpt2_seeds.py gpipe --process-generator

Each configuration trains 120 steps (AdamW 1e-2, batches of 8 of the causal task) from the
same initial weights under eight seeds of the global generator (mixed, so that each stage's own
stream, seeded from it, differs too) and prints one JSON line: the held-out losses, their mean
and standard deviation. ``--process-generator``: every stage draws from the process's generator
instead of a stream of its own, so that ``gpipe1`` (N = 1) draws one device's dropout masks,
in one device's order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytorch_lightning as pl
import torch

from pipemare import PipeMareConfig, PipeMareStrategy
from pipemare.engine import randomness
from support.models import quiet_trainer
from support.real_runs import val_loss
from support.zoo import GPT2Module, data


def strategy(name: str):
    """The run called ``name``: one device, a baseline, the default or the default changed."""
    even = dict(stages=2, balance="even")
    changed = {
        "t2": dict(discrepancy_correction=True),
        "no_wp": dict(weight_prediction=False),
        "no_spike": dict(spike_compensation=False),
        "no_dm": dict(delay_momentum=None),
    }
    if name == "one":
        return "auto"
    if name in ("gpipe", "1f1b"):
        return PipeMareStrategy(microbatches=2, schedule=name, **even)
    if name == "gpipe1":  # N = 1: with --process-generator, one device's masks in its order
        return PipeMareStrategy(microbatches=1, schedule="gpipe", **even)
    if name == "async":
        return PipeMareStrategy(schedule="async", **even)
    if name == "n4":
        return PipeMareStrategy(microbatches=4, **even)
    if name in changed:
        return PipeMareStrategy(config=PipeMareConfig(**changed[name]), **even)
    if name == "default":
        return PipeMareStrategy(**even)
    raise SystemExit(f"unknown configuration {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", help="comma-separated: one, gpipe, default, async, ...")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--process-generator", action="store_true")
    args = parser.parse_args()
    if args.process_generator:
        own = randomness.RandomStream.__init__
        randomness.RandomStream.__init__ = lambda self, seed: own(self, None)  # type: ignore
    for name in args.configs.split(","):
        losses = []
        for seed in range(args.seeds):
            pl.seed_everything(seed)
            module = GPT2Module(dropout=True)  # the same weights whatever the seed
            torch.manual_seed((seed * 6364136223846793005 + 1442695040888963407) % 2**63)
            quiet_trainer(strategy(name), max_steps=args.steps).fit(
                module, data("causal", n=8 * args.steps)
            )
            losses.append(round(val_loss(module, data("causal", n=64, seed=1)), 4))
        summary = {"config": name, "losses": losses, "mean": round(statistics.mean(losses), 4)}
        summary["sd"] = round(statistics.stdev(losses), 4) if len(losses) > 1 else 0.0
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
