"""``strategy="pipemare_1f1b"``'s own choice of N against measured step times.

Two gloo processes (Lightning's launcher), one thread each; the experiments' GPT over the char
corpus, batch 16; the step time is the wall clock between training steps 10 and 30 on rank 0.
Run alone on the machine, e.g. for the compute-bound GPT and the dispatch-bound one::

    for n in auto 1 2 4 8; do python experiments/results/baseline_n/measure.py 192 8 64 $n; done
    for n in auto 1 2 4; do python experiments/results/baseline_n/measure.py 64 4 32 $n; done

Each run prints the strategy's decision (with every N's replayed step) and a ``RESULT`` line.
"""

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.experiments.tasks.datamodules import CharCorpusDataModule
from pipemare.experiments.tasks.gpt import CharGPT


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.t.append(time.perf_counter())


def main(argv: list[str]) -> None:
    width, layers, context = (int(a) for a in argv[:3])
    n: int | str = "auto" if argv[3] == "auto" else int(argv[3])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    clock = _Clock()
    strategy = PipeMareStrategy(schedule="1f1b", microbatches=n)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    model = CharGPT(d_model=width, heads=4, layers=layers, context=context)
    trainer.fit(model, CharCorpusDataModule(context=context, batch_size=16))
    if trainer.global_rank == 0:
        steps = clock.t[10:]
        per = (steps[-1] - steps[0]) / (len(steps) - 1)
        result = {"width": width, "layers": layers, "context": context, "asked": n}
        print("RESULT", json.dumps({**result, "N": strategy.microbatches, "step_ms": per * 1e3}))


if __name__ == "__main__":
    main(sys.argv[1:])
