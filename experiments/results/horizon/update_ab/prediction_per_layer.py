"""Weight prediction's moves around each layer's own forward (a pre- and a post-hook per layer
of the stage) against around the stage's whole forward (the engine's way), on ``gpt_c64s``'s
stages at P = 4 and 8, a horizon of 2, alternated 120 times with 32 MB written before each:
does moving a layer's weights just before it reads them save the traffic of the moves?
(``README.md`` here.)"""

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from load_step_parts import step_parts

from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window
from pipemare.optim.corrections.prediction import WeightPrediction

torch.set_num_threads(1)


def per_layer(module: torch.nn.Module, moved: dict[Any, tuple[list, list]], alpha: float) -> Any:
    """A context in which each child of ``module`` runs its forward at ``w + alpha u``."""

    def move(child: Any, sign: float) -> None:
        params, steps = moved[child]
        if params:
            with torch.no_grad():
                torch._foreach_add_(params, steps, alpha=sign * alpha)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        handles = []
        for child in module.children():
            handles.append(child.register_forward_pre_hook(lambda c, _: move(c, 1.0)))
            handles.append(child.register_forward_hook(lambda c, _, __: move(c, -1.0)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    return context


task = TASKS["gpt_c64s"]
x, y, _, _ = task.data()
for p in (4, 8):
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), "pipemare", p, p, 1e-4, None, 0)
    timed_window(pipe, task, x, y, 8, 0)
    pred = next(c for c in pipe.optimizer.corrections if isinstance(c, WeightPrediction))
    inputs = step_parts._stage_inputs(pipe, x[: task.batch // p])
    cache = torch.zeros(8 << 20)
    for s, stage in enumerate(pipe.stages[:-1]):
        moved = {}
        for child in stage.module.children():
            params = [q for q in child.parameters() if q in pred.steps.neg]
            moved[child] = (params, [pred.steps.neg[q] for q in params])
        alpha = -2 * pred.scale * pred.view.stage_strength(s)
        ways = {
            "none": contextlib.nullcontext,
            "whole": functools.partial(pred.forward_weights, s, 2),
            "per layer": per_layer(stage.module, moved, alpha),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        leaves = step_parts._leaves(inputs[s], s > 0)
        for r in range(120):
            for way in list(ways)[r % 3 :] + list(ways)[: r % 3]:
                cache.add_(1.0)
                start = time.perf_counter()
                with ways[way]():
                    stage.module(leaves)
                times[way].append(time.perf_counter() - start)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        layers = len(list(stage.module.children()))
        print(
            f"P={p} stage {s} ({layers} layers): forward {med['none']:.2f} ms; whole "
            f"+{med['whole'] - med['none']:.2f}; per layer +{med['per layer'] - med['none']:.2f}",
            flush=True,
        )
