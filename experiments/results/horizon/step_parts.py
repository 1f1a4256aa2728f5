"""Where pipemare's replayed step stands against 1F1B's, in parts: how much more each stage's own
actions cost, how long stages wait on one another, and two of the engine's costs measured
directly (the saved-tensor hooks of the no-stash backward, and weight prediction in place or
out of place).

One process, the protocol's engine and the task's timed model (run it alone on the machine)::

    OMP_NUM_THREADS=1 python experiments/results/horizon/step_parts.py --stages 4 8

**Steps.** ``1f1b``, ``async`` and ``pipemare`` at N = P, and ``pipemare`` with its stages'
saved-tensor hooks on (as every asynchronous stage ran them before autograd saved the
parameters itself: :mod:`pipemare.engine.nostash`), their windows of ``--steps`` steps
taken in turn (``--repeats`` rounds, each starting one schedule later), each replayed as the
protocol replays it (:func:`pipemare.engine.telemetry.replay_timeline`, free links). Per
schedule, the median over the windows of:

- the replayed step;
- the busiest stage's own work per step (its forwards, backwards and update);
- the step over that work: 1F1B's bubble, or an asynchronous pipeline's waits (a stage
  waiting on its neighbour's action, and the window's own fill).

pipemare's step over 1F1B's is then the product of two ratios: its busiest stage's work over
1F1B's, and its waits factor over 1F1B's bubble factor.

**Hooks.** On a middle stage, one microbatch's forward and backward with the saved-tensor hooks
(parameters saved by reference, :mod:`pipemare.engine.nostash`) against without, alternated,
the median of ``--pairs``; and the number of tensors autograd saved.

**Weight prediction.** On each stage, one forward with the weights moved in place and back
(the engine's way), and with the predicted weights built out of place and swapped in as the
parameters' data, against a forward without prediction; a cache-sized buffer is written before
each, as the other actions of the step would, and the three are alternated (median of
``--pairs``).

**The update.** On stage 1, the user's optimiser over the stage's weights alone, and each
correction's hook before and after it, timed in turn with a cache-sized write before each
(median of ``--pairs``): what each correction adds to a stage's update.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

#: what is timed: the schedule, and whether its stages run the saved-tensor hooks (as every
#: asynchronous stage did before parameters were saved by autograd itself; they count the
#: bytes held too)
SCHEDULES = {
    "1f1b": ("1f1b", False),
    "async": ("async", False),
    "pipemare": ("pipemare", False),
    "pipemare, hooked": ("pipemare", True),
}


def _work(spans: list[Any], p: int) -> list[dict[str, float]]:
    """Each stage's seconds in forwards, backwards and updates over ``spans``."""
    per = [{"F": 0.0, "B": 0.0, "U": 0.0} for _ in range(p)]
    for stage, name, _, start, end in spans:
        if name in per[stage]:
            per[stage][name] += end - start
    return per


def steps_in_parts(task_name: str, p: int, steps: int, warm: int, repeats: int) -> None:
    from pipemare.engine.telemetry import replay_timeline
    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipes = {}
    for label, (schedule, hooked) in SCHEDULES.items():
        model = copy.deepcopy(_timed_model(task.name))
        pipes[label] = _pipeline(task, model, schedule, p, p, 1e-4, None, 0)
        for stage in pipes[label].stages:
            stage.measure_saved = stage.measure_saved or hooked
        timed_window(pipes[label], task, x, y, warm, 0)
    got: dict[str, dict[str, list[float]]] = {s: {"step": [], "work": []} for s in SCHEDULES}
    parts: dict[str, list[dict[str, float]]] = {s: [] for s in SCHEDULES}
    order = list(SCHEDULES)
    for r in range(repeats):
        for schedule in order[r % len(order) :] + order[: r % len(order)]:
            spans = timed_window(pipes[schedule], task, x, y, 0, steps)
            replayed, makespan = replay_timeline(spans, p, None)
            work = _work(replayed, p)
            busiest = max(work, key=lambda w: sum(w.values()))
            got[schedule]["step"].append(makespan / steps)
            got[schedule]["work"].append(sum(busiest.values()) / steps)
            parts[schedule].append({k: v / steps for k, v in busiest.items()})
    med = {s: {k: statistics.median(v) for k, v in got[s].items()} for s in SCHEDULES}
    print(f"{task_name}, P = {p}, N = {p}, {repeats} windows of {steps} steps each (median):")
    for s in SCHEDULES:
        f, b, u = (1e3 * statistics.median(w[k] for w in parts[s]) for k in "FBU")
        step, work = med[s]["step"], med[s]["work"]
        print(
            f"  {s}: step {1e3 * step:.1f} ms; busiest stage's work {1e3 * work:.1f} ms "
            f"(F {f:.1f} / B {b:.1f} / U {u:.1f}); step over work {step / work:.2f}"
        )
    one = med["1f1b"]
    for s in ("async", "pipemare", "pipemare, hooked"):
        m = med[s]
        print(
            f"  {s} over 1f1b: step {m['step'] / one['step']:.2f} = work "
            f"{m['work'] / one['work']:.2f} x waits {m['step'] / m['work']:.2f} / bubble "
            f"{one['step'] / one['work']:.2f}"
        )
    print(f"  1F1B's work without its bubble, over its step: {one['work'] / one['step']:.2f}")


def _stage_inputs(pipe: Any, microbatch: Any) -> list[Any]:
    """Each stage's input for ``microbatch``, the stages run one after another without a graph."""
    import torch

    inputs, h = [], microbatch
    with torch.no_grad():
        for stage in pipe.stages:
            inputs.append(h)
            h = stage.module(h)
    return inputs


def _leaves(inputs: Any, grad: bool) -> Any:
    def leaf(t: Any) -> Any:
        return t.detach().requires_grad_(grad) if t.is_floating_point() else t

    return tuple(leaf(t) for t in inputs) if isinstance(inputs, tuple) else leaf(inputs)


def _backward(out: Any) -> None:
    import torch

    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def hooks_cost(task_name: str, p: int, warm: int, pairs: int) -> None:
    import torch

    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), "pipemare", p, p, 1e-4, None, 0)
    timed_window(pipe, task, x, y, warm, 0)
    inputs = _stage_inputs(pipe, x[: task.batch // p])
    stage = pipe.stages[1]  # a middle stage, one of the busiest (stage 0 embeds, the last ends)
    saved = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        stage.module(_leaves(inputs[1], True))

    def run(hooked: bool) -> float:
        start = time.perf_counter()
        hooks = stage._saved.hooks(stage.version, True, None)
        with hooks if hooked else contextlib.nullcontext():
            out = stage.module(_leaves(inputs[1], True))
        _backward(out)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(pairs):
        for hooked in (True, False) if r % 2 else (False, True):
            times[hooked].append(run(hooked))
    with_, without = (1e3 * statistics.median(times[k]) for k in (True, False))
    print(
        f"  hooks, P = {p} stage 1: forward + backward of one microbatch {without:.2f} ms without, "
        f"{with_:.2f} ms with (+{with_ - without:.2f} ms, {with_ / without - 1:+.1%}); "
        f"{saved[0]} tensors saved per forward"
    )


@contextlib.contextmanager
def _out_of_place(params: list[Any], steps: list[Any], alpha: float) -> Iterator[None]:
    """The alternative measured: ``w + alpha u`` built in one fused pass and swapped in as each
    parameter's data for the forward, the live tensors swapped back after it (exact, but one
    copy of the stage's weights for the forward's duration)."""
    import torch

    live = [q.data for q in params]
    with torch.no_grad():
        predicted = torch._foreach_add(live, steps, alpha=alpha)
    for q, w in zip(params, predicted, strict=True):
        q.data = w
    try:
        yield
    finally:
        for q, w in zip(params, live, strict=True):
            q.data = w


def prediction_cost(task_name: str, p: int, warm: int, pairs: int, horizon: int = 2) -> None:
    import torch

    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window
    from pipemare.optim.corrections.prediction import WeightPrediction

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), "pipemare", p, p, 1e-4, None, 0)
    timed_window(pipe, task, x, y, warm, 0)
    prediction = next(c for c in pipe.optimizer.corrections if isinstance(c, WeightPrediction))
    inputs = _stage_inputs(pipe, x[: task.batch // p])
    cache = torch.zeros(8 << 20)  # 32 MB, past this machine's caches
    for s, stage in enumerate(pipe.stages[:-1]):
        params = [q for q in prediction.view.params[s] if q in prediction.steps.neg]
        steps = [prediction.steps.neg[q] for q in params]
        alpha = -horizon * prediction.scale * prediction.view.stage_strength(s)
        ways = {
            "none": contextlib.nullcontext,
            "in place": functools.partial(prediction.forward_weights, s, horizon),
            "out of place": functools.partial(_out_of_place, params, steps, alpha),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        leaves = _leaves(inputs[s], s > 0)
        for r in range(pairs):
            for way in list(ways)[r % 3 :] + list(ways)[: r % 3]:
                cache.add_(1.0)
                start = time.perf_counter()
                with ways[way]():
                    stage.module(leaves)
                times[way].append(time.perf_counter() - start)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(
            f"  prediction, P = {p} stage {s}: a forward {med['none']:.2f} ms; in place "
            f"+{med['in place'] - med['none']:.2f} ms, out of place "
            f"+{med['out of place'] - med['none']:.2f} ms"
        )


def update_cost(task_name: str, p: int, warm: int, pairs: int) -> None:
    import torch

    from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window
    from pipemare.optim.corrections.base import Correction

    task = TASKS[task_name]
    x, y, _, _ = task.data()
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), "pipemare", p, p, 1e-4, None, 0)
    timed_window(pipe, task, x, y, warm, 0)
    wrapper, s = pipe.optimizer, 1  # a middle stage, one of the busiest
    params = wrapper.stage_parameters(s)
    for q in params:  # gradients of a trained step's size; their values change no timing
        q.grad = torch.randn_like(q) * 1e-3
    used = [
        {k: v for k, v in g.items() if k != "params"}
        for g, mine in zip(wrapper.optimizer.param_groups, wrapper._groups[s], strict=True)
        for _ in mine
    ]

    def adamw() -> None:  # the user's optimiser over this stage's weights alone
        groups = wrapper.optimizer.param_groups
        kept = [g["params"] for g in groups]
        for g, mine in zip(groups, wrapper._groups[s], strict=True):
            g["params"] = mine
        try:
            wrapper.optimizer.step()
        finally:
            for g, k in zip(groups, kept, strict=True):
                g["params"] = k

    parts = {"the optimiser's step": adamw}
    for c in wrapper.corrections:
        name = type(c).__name__
        if type(c).before_step is not Correction.before_step:  # a hook of its own
            parts[f"{name}, before"] = functools.partial(c.before_step, s, params)
        if type(c).after_step is not Correction.after_step:
            parts[f"{name}, after"] = functools.partial(c.after_step, s, 10**6, params, used)
    cache = torch.zeros(8 << 20)  # 32 MB written before each: the step's other actions would
    times: dict[str, list[float]] = {k: [] for k in parts}
    order = list(parts)
    for r in range(pairs):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            cache.add_(1.0)
            start = time.perf_counter()
            parts[name]()
            times[name].append(time.perf_counter() - start)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    base = med.pop("the optimiser's step")
    extra = sum(med.values())
    weights = sum(q.numel() for q in params)
    print(
        f"  update, P = {p} stage {s} ({weights:,} weights): the optimiser's step {base:.2f} ms; "
        + "; ".join(f"{k} +{v:.2f}" for k, v in med.items())
        + f"; the corrections +{extra:.2f} ms ({extra / base:+.0%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt_c64s")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="steps per window (the protocol's)")
    parser.add_argument("--repeats", type=int, default=6, help="windows per schedule")
    parser.add_argument("--pairs", type=int, default=80, help="alternations of the direct timings")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    for p in args.stages:
        steps_in_parts(args.task, p, args.steps, args.warm, args.repeats)
        hooks_cost(args.task, p, args.warm, args.pairs)
        prediction_cost(args.task, p, args.warm, args.pairs)
        update_cost(args.task, p, args.warm, args.pairs)


if __name__ == "__main__":
    main()
