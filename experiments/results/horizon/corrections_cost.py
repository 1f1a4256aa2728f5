"""Where pipemare's step goes beyond an uncorrected asynchronous one: each stage's forwards,
backwards and updates per step, and the corrections' share of an update.

One process, the protocol's engine (:mod:`pipemare.experiments.studies.protocol`), the task's
timed model, one window of ``--steps`` steps after ``--warm`` (run it alone on the machine)::

    OMP_NUM_THREADS=1 python experiments/results/horizon/corrections_cost.py --stages 8

For each schedule: the replayed step and, per stage, its forwards / backwards / updates in ms
per step; for ``pipemare`` also each correction's hooks around the optimiser step, the user's
optimiser step itself, the engine's check for non-finite gradients, and one enter-and-exit of
the forward's weight prediction, per stage and step.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any


def _timed(into: dict[Any, float], key: Callable[..., Any], fn: Callable[..., Any]) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key(*args)] += time.perf_counter() - start

    return run


def _measure(task_name: str, schedule: str, p: int, n: int, warm: int, steps: int) -> None:
    from pipemare.engine.telemetry import replay_timeline
    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), schedule, p, n, 1e-4, None, 0)
    hooks: dict[Any, float] = collections.defaultdict(float)
    optimizer = pipe.optimizer
    current = [0]
    step = optimizer.step

    def stepped(stage: int, minibatch: int) -> None:
        current[0] = stage
        step(stage, minibatch)

    optimizer.step = stepped  # type: ignore[method-assign]
    for c in optimizer.corrections:
        for hook in ("before_step", "after_step"):
            setattr(c, hook, _timed(hooks, lambda *a, c=c: (c.name, current[0]), getattr(c, hook)))
    optimizer.optimizer.step = _timed(  # type: ignore[method-assign]
        hooks, lambda *_: ("the optimiser's own step", current[0]), optimizer.optimizer.step
    )
    check = pipe.executor._nonfinite
    pipe.executor._nonfinite = _timed(  # type: ignore[method-assign]
        hooks, lambda stage: ("the check for non-finite gradients", stage.index), check
    )
    timed_window(pipe, task, x, y, warm, 0)
    hooks.clear()
    spans = timed_window(pipe, task, x, y, 0, steps)
    _, makespan = replay_timeline(spans, p, None)
    per: dict[tuple[int, str], float] = collections.defaultdict(float)
    for stage, name, _, start, end in spans:
        per[stage, name] += (end - start) / steps
    print(f"{schedule} P = {p}, N = {n}: replayed step {1e3 * makespan / steps:.1f} ms")
    for s in range(p):
        f, b, u = (1e3 * per[s, k] for k in "FBU")
        print(f"  stage {s}: forwards {f:.1f} / backwards {b:.1f} / update {u:.1f} ms per step")
    for (what, s), seconds in sorted(hooks.items(), key=lambda kv: (kv[0][1], -kv[1])):
        if seconds / steps >= 5e-5:
            print(f"  stage {s}, {what}: {1e3 * seconds / steps:.2f} ms per step")
    if "weight_prediction" in [c.name for c in optimizer.corrections]:
        for s in range(p):
            spent = []
            for _ in range(21):
                start = time.perf_counter()
                with optimizer.forward_weights(s, 1):
                    pass
                spent.append(time.perf_counter() - start)
            print(
                f"  stage {s}, one forward's weight prediction: "
                f"{1e3 * statistics.median(spent):.2f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt_c64s")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, help="N (default: P)")
    parser.add_argument("--schedules", nargs="+", default=["async", "pipemare"])
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    for schedule in args.schedules:
        n = args.microbatches or args.stages
        _measure(args.task, schedule, args.stages, n, args.warm, args.steps)


if __name__ == "__main__":
    main()
