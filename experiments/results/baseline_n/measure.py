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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from pipemare import PipeMareStrategy
from pipemare.experiments.studies.step_clock import timed_fit


def main(argv: list[str]) -> None:
    width, layers, context = (int(a) for a in argv[:3])
    n: int | str = "auto" if argv[3] == "auto" else int(argv[3])
    strategy = PipeMareStrategy(schedule="1f1b", microbatches=n)
    trainer, step_ms = timed_fit(strategy, width, layers, context)
    if trainer.global_rank == 0:
        result = {"width": width, "layers": layers, "context": context, "asked": n}
        print("RESULT", json.dumps({**result, "N": strategy.microbatches, "step_ms": step_ms}))


if __name__ == "__main__":
    main(sys.argv[1:])
