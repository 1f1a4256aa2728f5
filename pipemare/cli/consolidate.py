"""``pipemare consolidate CHECKPOINT OUTPUT``: per-stage shards into one Lightning checkpoint.

What Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` does for
``ModelParallelStrategy``'s shards, for pipemare's (:mod:`pipemare.lightning.shards`): the
output is the file a run with ``save_distributed_checkpoint=False`` writes, which
``LightningModule.load_from_checkpoint`` reads on one device and ``fit(ckpt_path=...)`` resumes
at any P. The whole model passes through this one process's memory.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["run_consolidate"]


def run_consolidate(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pipemare consolidate",
        description="Turn a directory of per-stage shards into one Lightning checkpoint file.",
    )
    parser.add_argument("checkpoint", help="the checkpoint directory a pipemare run wrote")
    parser.add_argument("output", help="the file to write (e.g. whole.ckpt)")
    args = parser.parse_args(argv)
    from pipemare.lightning import shards
    from pipemare.lightning.checkpoint_io import atomic_save

    if not shards.is_sharded(args.checkpoint):
        print(
            f"error: {args.checkpoint} is not a directory of per-stage shards (it has no "
            f"{shards.META} and .metadata); a single-file checkpoint needs no consolidation",
            file=sys.stderr,
        )
        raise SystemExit(2)
    atomic_save(shards.consolidate_checkpoint(args.checkpoint), args.output)
    size = os.path.getsize(args.output) / 2**20
    print(f"wrote {args.output} ({size:.1f} MB), the whole model of {args.checkpoint}")
