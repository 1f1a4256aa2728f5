"""One process of a 2-process run of what users ask pipeline libraries for, started by
Lightning's launcher (``devices=2``, one stage per process, gloo):

- ``--task gpt2``: a Hugging Face GPT-2 from ``GPT2Config()`` with only its sizes shrunk
  (``--no-dropout``: its dropout set to 0 as well) through ``Trainer(strategy=<name>)``,
  the strategy given by its registered name and nothing else;
- ``--task padded``: the zoo's GPT-2 on batches padded to their own longest sequence
  (``support.zoo.padded_data``);
- ``--task gpt``: the tied nanoGPT validated before any fit, then resumed from a checkpoint
  written at another P (``--ckpt``) and trained on to ``--steps``.

``--compile``: the Hugging Face model passed through ``torch.compile`` as on one device.
``--then-default-steps``: after a ``gpt2`` run, a second Trainer in the same processes trains
the config as it ships through ``strategy="pipemare"`` (one launch for both runs).

Every rank writes ``report-<rank>.json``: the validation losses, the step reached, the
schedule and N the strategy chose.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from support.models import quiet_trainer
from support.real_modules import GPTModule, tokens
from support.zoo import GPT2Module, ZooModule, data, padded_data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--task", choices=("gpt2", "gpt", "padded"), required=True)
    parser.add_argument("--strategy", default="pipemare")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--no-dropout", action="store_true")
    parser.add_argument("--ckpt")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--layers", type=int, default=4, help="gpt2: its blocks")
    parser.add_argument(
        "--then-default-steps",
        type=int,
        help="gpt2: then, in the same processes, the config as it ships (dropout on) through "
        "strategy='pipemare' for this many steps; its reports in OUT/default",
    )
    args = parser.parse_args()
    run(args, Path(args.out), args.strategy, args.steps, dropout=not args.no_dropout)
    if args.then_default_steps:
        (Path(args.out) / "default").mkdir(exist_ok=True)
        run(args, Path(args.out) / "default", "pipemare", args.then_default_steps, dropout=True)


def run(args: argparse.Namespace, out: Path, strategy: str, steps: int, dropout: bool) -> None:
    """One Trainer through ``strategy`` (a registered name) for ``steps``; the report in
    ``out``."""
    # the loader as it is, so that one device sees the same batches
    trainer = quiet_trainer(strategy, devices=2, max_steps=steps, use_distributed_sampler=False)
    report: dict = {}
    if args.task == "gpt2":
        model = GPT2Module(dropout=dropout, layers=args.layers)
        if args.compile:
            model.model = torch.compile(model.model)
            # its C++ compiled in this process, not in a pool of compile workers that each
            # import torch: on two cores shared by two ranks the pool only adds its start
            from torch._inductor import config as inductor

            inductor.compile_threads = 1
        trainer.fit(model, data("causal", n=8 * steps))
        (val,) = trainer.validate(model, data("causal", n=64, seed=1), verbose=False)
    elif args.task == "padded":
        model = ZooModule("gpt2")
        trainer.fit(model, padded_data())
        (val,) = trainer.validate(model, padded_data(n=32, seed=1), verbose=False)
    else:
        model = GPTModule()
        (before,) = trainer.validate(model, tokens(), verbose=False)
        report["val_before_fit"] = before["val_loss"]
        trainer.fit(model, tokens(n=256), ckpt_path=args.ckpt)
        (val,) = trainer.validate(model, tokens(), verbose=False)
    pipeline = trainer.strategy
    report.update(
        val_loss=val["val_loss"],
        global_step=trainer.global_step,
        schedule=pipeline.schedule,
        microbatches=pipeline.microbatches,
        stages=pipeline.num_stages,
    )
    (out / f"report-{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
