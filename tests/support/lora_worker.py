"""One process of a two-process fine-tuning run (tests/lightning/test_lora.py), started by
Lightning's launcher over gloo, a stage each. For each of ``--models`` (support/lora.py's
MODELS) in turn, from its pretrained checkpoint: gpipe for ``--equal-steps`` with Lightning's
ModelCheckpoint writing mid-run (every half of them), then the default schedule for
``--train-steps``, whose adapter (or model) rank 0 saves with ``save_pretrained`` into
``MODEL/saved``, then uncorrected ``async`` as long. Every rank reports each run's held-out
loss. Last, the fine-tuning example of docs/your-model.md as it is written, its adapter into
``doc-example``."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from pytorch_lightning.callbacks import ModelCheckpoint

from pipemare import PipeMareStrategy
from support.lora import MODELS, FineTune, task
from support.models import quiet_trainer
from support.zoo import QUALITY_CUT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pretrained", nargs="+", required=True, help="FAMILY=DIRECTORY")
    parser.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    parser.add_argument("--equal-steps", type=int, default=10)
    parser.add_argument("--train-steps", type=int, default=40)
    args = parser.parse_args()
    pretrained = dict(item.split("=", 1) for item in args.pretrained)
    for name in args.models:
        family, _ = MODELS[name]
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        report, rank = {}, 0
        runs = (("gpipe", args.equal_steps), ("pipemare", args.train_steps))
        for schedule, steps in (*runs, ("async", args.train_steps)):
            module = FineTune(name, pretrained=pretrained[family])
            every = ModelCheckpoint(
                dirpath=out / "checkpoints",
                filename="{step}",
                every_n_train_steps=steps // 2,
                save_top_k=-1,
            )
            gpipe = schedule == "gpipe"
            # the default as users get it (nothing named), the others by name; the runs held to
            # a quality bound on support.zoo.QUALITY_CUT
            named = {} if schedule == "pipemare" else {"schedule": schedule}
            if not gpipe:
                named["balance"] = QUALITY_CUT
            trainer = quiet_trainer(
                PipeMareStrategy(**named),
                devices=2,
                max_steps=steps,
                use_distributed_sampler=False,  # the batches one device sees
                enable_checkpointing=gpipe,
                callbacks=[every] if gpipe else [],
            )
            trainer.fit(module, task())
            (val,) = trainer.validate(module, task(n=64, seed=1), verbose=False)
            strategy = trainer.strategy
            report[schedule] = {
                "val_loss": val["val_loss"],
                "schedule": strategy.schedule,  # type: ignore[attr-defined]
                "microbatches": strategy.microbatches,  # type: ignore[attr-defined]
                "global_step": trainer.global_step,
            }
            rank = trainer.global_rank
            if schedule == "pipemare" and rank == 0:
                module.save_pretrained(out / "saved")
        (out / f"report-{rank}.json").write_text(json.dumps(report))
    docs_example(Path(args.out) / "doc-example", pretrained["gpt2"], args.train_steps)


def docs_example(out: Path, checkpoint: str, steps: int) -> None:
    """docs/your-model.md's fine-tuning example, run as written, in a directory of its own
    (its Trainer writes logs where it runs)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "your-model.md").read_text()
    (code,) = re.findall(r"```python\n(# fine-tuning example\n.*?)```", page, re.S)
    namespace: dict = {}
    exec(compile(code, "docs/your-model.md", "exec"), namespace)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    namespace["fine_tune"](checkpoint, task(), str(out / "adapter"), steps=steps)


if __name__ == "__main__":
    main()
