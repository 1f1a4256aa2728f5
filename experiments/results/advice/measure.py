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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from pipemare import PipeMareStrategy
from pipemare.experiments.studies.step_clock import timed_fit


def main(argv: list[str]) -> None:
    width, layers, context = (int(a) for a in argv[:3])
    schedule = argv[3]
    if schedule == "pipemare":
        strategy = PipeMareStrategy()
    else:
        strategy = PipeMareStrategy(schedule="1f1b", microbatches=int(argv[4]), advise=False)
    trainer, step_ms = timed_fit(strategy, width, layers, context)
    if trainer.global_rank == 0:
        result = {"width": width, "layers": layers, "context": context, "schedule": schedule}
        result |= {"N": strategy.microbatches, "step_ms": step_ms}
        advice = strategy.advice
        if advice is not None:
            result |= {
                "advice": advice.steps_sooner,
                "verdict": advice.verdict,
                "predicted_ratio": advice.ratio,
                "predicted_ms": advice.step_s * 1e3,
                "baseline_n": advice.baseline_n,
                "baseline_predicted_ms": advice.baseline_s * 1e3,
            }
        print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
