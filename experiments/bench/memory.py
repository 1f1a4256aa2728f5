"""The benchmark's model (an MLP) and its byte counters: weights, optimiser state, saved
activations, the stash-against-buffers memory study, and a process's memory over a long run.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch
from torch import nn

from pipemare.callbacks.memory import memory_now
from pipemare.model import partition


def mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    """``depth`` blocks of Linear(width, width) + GELU, then a linear classifier (seeded)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def live_tensors() -> int:
    """Tensors Python can reach, after a full collection."""
    gc.collect()
    # by type: isinstance on some module-level objects of torch warns of their deprecation
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def memory_sample() -> tuple[float, float | None]:
    """Resident MB of this process, and the MB its tensors hold on the current CUDA device
    (None where CUDA is not in use)."""
    now = memory_now()
    return now.get("resident_mb", now["peak_resident_mb"]), now.get("cuda_allocated_mb")


def memory_growth(trace: list[tuple[int, float, float | None]]) -> dict[str, float]:
    """MB gained per 1,000 steps over ``(step, resident MB, CUDA MB)`` samples (a least-squares
    slope, so one allocation at the start does not read as growth)."""
    growth = {"resident_mb_per_1000": growth_per_1000([(s, r) for s, r, _ in trace])}
    if trace and trace[0][2] is not None:
        growth["cuda_mb_per_1000"] = growth_per_1000([(s, c or 0.0) for s, _, c in trace])
    return growth


def growth_per_1000(samples: list[tuple[int, float]]) -> float:
    """The least-squares slope of ``(step, value)`` samples, per 1,000 steps (0 for < 2)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(s for s, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((s - mx) ** 2 for s, _ in samples)
    if var == 0:
        return 0.0
    return 1000 * sum((s - mx) * (v - my) for s, v in samples) / var


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors among ``tensors`` (an iterable; other items are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> int:
    """Bytes of ``opt``'s state (momentum, ...) for ``params``."""
    return sum(tensor_bytes(opt.state[p].values()) for p in params if p in opt.state)


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of ``module`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def memory_study(stages: list[int], width: int, depth: int, batch: int, n: int) -> list[dict]:
    """Stage 0's extra weight memory: pipedream's stash against pipemare's buffers (simulated).

    Analytic: pipedream keeps one stashed copy per weight version still awaited by an
    in-flight microbatch, ``ceil((P-1)/N)`` copies of stage 0's weights at most; pipemare keeps
    the buffers its corrections declare (a count of weight-sized tensors, times the weights).
    """
    from pipemare import Pipeline

    rows = []
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, width, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    for p in stages:
        model = mlp(width, depth)
        w0 = tensor_bytes(model[: partition.balance_by_params(model, p)[0]].parameters())
        row: dict[str, Any] = {"stages": p, "microbatches": n, "stage0_weights": w0}
        for schedule in ("pipedream", "pipemare"):
            model = mlp(width, depth)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
            pipe = Pipeline(
                model,
                opt,
                nn.functional.cross_entropy,
                stages=p,
                microbatches=n,
                schedule=schedule,
                balance="params",
            )
            for _ in range(p + 2):
                pipe.step((x, y))
            stage = pipe.stages[0]
            if schedule == "pipedream":
                row["stash_measured"] = stage.peak_stashed_versions * w0
                row["stash_analytic"] = math.ceil((p - 1) / n) * w0
            else:
                row["buffers_measured"] = sum(pipe.optimizer.buffer_bytes(0).values())
                row["buffers_by_correction"] = pipe.optimizer.buffer_bytes(0)
            pipe.drain()
        rows.append(row)
    return rows
