"""The advice at setup against 20 real steps of both schedules (issue 49, item 2).

Two gloo processes (Lightning's launcher), one thread each; the experiments' GPT over the char
corpus, batch 16; a step's time is the wall clock between training steps 10 and 30 on rank 0.
``pipemare`` runs the default (its first lines carry the advice, printed here with what it
predicted); ``1f1b N`` runs ``strategy="pipemare_1f1b"`` at the N the advice named. Run alone
on the machine, for the compute-bound GPT and the dispatch-bound one::

    python experiments/results/advice/measure.py 192 8 64 pipemare   # prints 1F1B's N
    python experiments/results/advice/measure.py 192 8 64 1f1b N
    python experiments/results/advice/measure.py 64 4 32 pipemare
    python experiments/results/advice/measure.py 64 4 32 1f1b N

Each run prints a ``RESULT`` line; the measured ratio is pipemare's step over 1F1B's.
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
    schedule = argv[3]
    torch.set_num_threads(1)
    pl.seed_everything(0)
    clock = _Clock()
    if schedule == "pipemare":
        strategy = PipeMareStrategy()
    else:
        strategy = PipeMareStrategy(schedule="1f1b", microbatches=int(argv[4]), advise=False)
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
        result = {"width": width, "layers": layers, "context": context, "schedule": schedule}
        result |= {"N": strategy.microbatches, "step_ms": per * 1e3}
        advice = strategy.advice
        if advice is not None:
            result |= {
                "advice": advice.favours,
                "predicted_ratio": advice.ratio,
                "predicted_ms": advice.step_s * 1e3,
                "baseline_n": advice.baseline_n,
                "baseline_predicted_ms": advice.baseline_s * 1e3,
            }
        print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
