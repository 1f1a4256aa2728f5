"""Where pipemare's step goes beyond an uncorrected asynchronous one: each stage's forwards,
backwards and updates per step, and the corrections' share of an update.

One process, the protocol's engine (:mod:`pipemare.experiments.studies.protocol`), the task's
timed model, one window of ``--steps`` steps after ``--warm`` (run it alone on the machine)::

    OMP_NUM_THREADS=1 python experiments/results/horizon/corrections_cost.py --stages 8

For each schedule: the replayed step and, per stage, its forwards / backwards / updates in ms
per step; for ``pipemare`` also each correction's hooks around the optimiser step, the user's
optimiser step itself, the engine's check for non-finite gradients, and the forwards' weight
prediction (moving the weights and moving them back), per stage and step. The prediction is
timed inside the window, where its passes over the weights meet caches the forwards and
backwards have filled: there it costs several times what one enter-and-exit costs timed on its
own in a loop.

``--ablate`` answers the same question by subtraction: the replayed step of ``async``, of
``pipemare``, and of ``pipemare`` with each costly correction switched off in turn and with all
three off, their windows taken in turn (the first of each, then the second of each, ...; the
median of ``--repeats``; each round starts one variant later), so that a drift of the
machine's speed falls on all alike; and, on the stage busiest under ``async``, each variant's
least forwards, backwards and update per step over the windows (each kind's minimum on its
own, so their sum is a lower bound, not one window's work)::

    OMP_NUM_THREADS=1 python experiments/results/horizon/corrections_cost.py --stages 4 8 --ablate \
        --repeats 7
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterator
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


def _per_stage(spans: list[Any], steps: int) -> collections.defaultdict[tuple[int, str], float]:
    """Seconds per step each stage spent in each kind of action (F, B, U, ...) over ``spans``."""
    per: collections.defaultdict[tuple[int, str], float] = collections.defaultdict(float)
    for stage, name, _, start, end in spans:
        per[stage, name] += (end - start) / steps
    return per


def _time_prediction(pipe: Any) -> list[float]:
    """Wrap each stage's forward weight prediction so that the seconds it spends moving the
    weights and moving them back add up, per stage, in the list returned."""
    spent = [0.0] * len(pipe.stages)
    for stage in pipe.stages:
        move = stage._forward_weights
        if move is None:
            continue

        @contextlib.contextmanager
        def timed(index: int, horizon: int, move: Any = move) -> Iterator[None]:
            start = time.perf_counter()
            with move(index, horizon):
                spent[index] += time.perf_counter() - start
                yield
                start = time.perf_counter()
            spent[index] += time.perf_counter() - start

        stage._forward_weights = timed
    return spent


#: ``--ablate``'s variants: (label, schedule, the corrections switched off)
VARIANTS = (
    ("async", "async", ()),
    ("pipemare", "pipemare", ()),
    ("pipemare without weight prediction", "pipemare", ("weight_prediction",)),
    ("pipemare without spike compensation", "pipemare", ("spike_compensation",)),
    ("pipemare without the stability guard", "pipemare", ("stability_guard",)),
    (
        "pipemare without all three",
        "pipemare",
        ("weight_prediction", "spike_compensation", "stability_guard"),
    ),
)


def _ablate(task_name: str, p: int, n: int, warm: int, steps: int, repeats: int) -> None:
    from pipemare import PipeMareConfig
    from pipemare.engine.telemetry import replay_timeline
    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipes = []
    for label, schedule, off in VARIANTS:
        config = PipeMareConfig(**dict.fromkeys(off, False)) if off else None
        model = copy.deepcopy(_timed_model(task.name))
        pipe = _pipeline(task, model, schedule, p, n, 1e-4, config, 0)
        names = {c.name for c in pipe.optimizer.corrections}
        assert not names & set(off), f"{label}: {sorted(names & set(off))} still run"
        pipes.append((label, pipe))
    replayed: dict[str, list[float]] = {label: [] for label, _ in pipes}
    # per variant, stage and kind of action: its seconds per step in each window
    work: dict[tuple[str, int, str], list[float]] = collections.defaultdict(list)
    for r in range(repeats):
        # each round starts one variant later, so that no variant always follows the same one
        for label, pipe in pipes[r % len(pipes) :] + pipes[: r % len(pipes)]:
            spans = timed_window(pipe, task, x, y, warm, steps)
            replayed[label].append(replay_timeline(spans, p, None)[1] / steps)
            for (stage, name), seconds in _per_stage(spans, steps).items():
                work[label, stage, name].append(seconds)
    base = statistics.median(replayed["async"])
    print(f"P = {p}, N = {n}, the median of {repeats} windows of {steps} steps taken in turn:")
    for label, values in replayed.items():
        mid = statistics.median(values)
        spread = f"{1e3 * min(values):.1f}-{1e3 * max(values):.1f}"
        print(f"  {label}: {1e3 * mid:.1f} ms ({spread}), {mid / base:.2f}x async's")
    # a slower machine only lengthens a window, so each stage's least work over the windows
    # is the steadiest measure of what the code itself costs
    least = {key: min(values) for key, values in work.items()}
    busiest = max(range(p), key=lambda s: sum(least["async", s, k] for k in "FBU"))
    print(
        f"  stage {busiest}'s least work per step over the windows, forwards / backwards / update:"
    )
    ref = sum(least["async", busiest, k] for k in "FBU")
    for label, _ in pipes:
        f, b, u = (least[label, busiest, k] for k in "FBU")
        total = f + b + u
        print(
            f"    {label}: {1e3 * f:.1f} / {1e3 * b:.1f} / {1e3 * u:.1f} ms, "
            f"{1e3 * total:.1f} ms, {total / ref:.2f}x async's"
        )


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

    def stepped(stage: int, minibatch: int, grad_norms: Any = None) -> None:
        current[0] = stage
        step(stage, minibatch, grad_norms)

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
    predicted = _time_prediction(pipe)
    timed_window(pipe, task, x, y, warm, 0)
    hooks.clear()
    predicted[:] = [0.0] * p
    spans = timed_window(pipe, task, x, y, 0, steps)
    _, makespan = replay_timeline(spans, p, None)
    per = _per_stage(spans, steps)
    print(f"{schedule} P = {p}, N = {n}: replayed step {1e3 * makespan / steps:.1f} ms")
    for s in range(p):
        f, b, u = (1e3 * per[s, k] for k in "FBU")
        print(f"  stage {s}: forwards {f:.1f} / backwards {b:.1f} / update {u:.1f} ms per step")
    for (what, s), seconds in sorted(hooks.items(), key=lambda kv: (kv[0][1], -kv[1])):
        if seconds / steps >= 5e-5:
            print(f"  stage {s}, {what}: {1e3 * seconds / steps:.2f} ms per step")
    for s in range(p):
        if predicted[s]:
            print(
                f"  stage {s}, the forwards' weight prediction: {1e3 * predicted[s] / steps:.2f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt_c64s")
    parser.add_argument("--stages", type=int, nargs="+", default=[8])
    parser.add_argument("--microbatches", type=int, help="N (default: P)")
    parser.add_argument("--schedules", nargs="+", default=["async", "pipemare"])
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ablate", action="store_true", help="the step with corrections off")
    parser.add_argument("--repeats", type=int, default=5, help="--ablate's windows")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    for p in args.stages:
        n = args.microbatches or p
        if args.ablate:
            _ablate(args.task, p, n, args.warm, args.steps, args.repeats)
            continue
        for schedule in args.schedules:
            _measure(args.task, schedule, p, n, args.warm, args.steps)


if __name__ == "__main__":
    main()
