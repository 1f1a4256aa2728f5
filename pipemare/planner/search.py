"""The search: contiguous cuts by dynamic programming within a memory limit, and the P x D x N
candidates a plan compares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.model import partition
from pipemare.optim.config import PipeMareConfig
from pipemare.planner.cost import (
    Layout,
    _bounds,
    _check_schedule,
    _check_whole,
    _Costs,
    _modelled_layout,
)
from pipemare.planner.measurements import ForwardContext, OptimizerFactory, Profile
from pipemare.planner.profile import profile
from pipemare.planner.report import Plan, _size
from pipemare.planner.streams import _streams
from pipemare.schedule.actions import spec

#: Microbatch counts :func:`plan` tries by default.
DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)


#: Layouts modelled within this fraction of the fastest are ties, won by the most even cut.
DEFAULT_TOLERANCE = 0.01


def _cut(
    num_layers: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    even_first: bool = False,
) -> list[int] | None:
    """Contiguous cut of ``num_layers`` layers into ``stages`` minimising the largest
    ``cost(stage, begin, end)``; infinite costs are forbidden (see
    :func:`pipemare.model.partition._min_max_cut`). None when no cut is allowed."""

    def allowed(j: int, begin: int, end: int) -> float | None:
        c = cost(j, begin, end)
        return None if c == math.inf else c

    return partition._min_max_cut(num_layers, stages, allowed, even_first=even_first)


def _best_layout(
    costs: _Costs,
    schedule: str,
    stages: int,
    limit: float | None,
    tolerance: float,
    replicas: int,
    microbatch_size: int,
) -> Layout | None:
    """The fastest modelled cut within memory; None when no cut fits.

    The dynamic programme proposes cuts: the one whose slowest stage (compute, or its
    outgoing link) is fastest; the most even one (in layers per stage) whose slowest stage is
    within ``tolerance`` of that; for flushing schedules, the one whose slowest forward and
    backward pass per microbatch is fastest (fill and drain run at that pace). Each is
    replayed; the fastest wins, and layouts within ``tolerance`` of it count as a tie that
    the most even cut wins (a profile is measured, so it is noisy).
    """
    peaks = _streams(schedule, stages, costs.microbatches).peaks

    def fits(j: int, a: int, b: int) -> bool:
        return limit is None or costs.memory(a, b, *peaks[j]) <= limit

    def busy(j: int, a: int, b: int) -> float:
        return max(costs.busy(a, b), costs.link(b)) if fits(j, a, b) else math.inf

    def pace(j: int, a: int, b: int) -> float:
        f, bw, _ = costs.times(a, b)
        return max(f + bw, costs.link(b) / costs.microbatches) if fits(j, a, b) else math.inf

    fastest = _cut(costs.n, stages, busy)
    if fastest is None:
        return None
    cuts = [fastest]
    if tolerance > 0:
        bound = (1 + tolerance) * max(busy(j, a, b) for j, (a, b) in enumerate(_bounds(fastest)))
        near = _cut(costs.n, stages, lambda j, a, b: _within(busy(j, a, b), bound), True)
        cuts.append(near or fastest)
    if spec(schedule).flushes:
        cuts.append(_cut(costs.n, stages, pace) or fastest)
    layouts = {
        tuple(c): _modelled_layout(costs, schedule, c, replicas, microbatch_size) for c in cuts
    }
    quickest = min(lay.step_s for lay in layouts.values())
    ties = [lay for lay in layouts.values() if lay.step_s <= quickest * (1 + tolerance)]
    ideal = costs.n / stages
    return min(ties, key=lambda lay: sum(abs(b - ideal) for b in lay.balance))


def _within(cost: float, bound: float) -> float:
    return cost if cost <= bound else math.inf


def _least_memory(costs: _Costs, schedule: str, stages: int) -> tuple[float, list[int]]:
    """The smallest fullest-stage memory any cut reaches, and that cut."""
    peaks = _streams(schedule, stages, costs.microbatches).peaks
    balance = _cut(costs.n, stages, lambda j, a, b: costs.memory(a, b, *peaks[j]))
    assert balance is not None  # without a limit some cut always exists
    bounds = _bounds(balance)
    return max(costs.memory(a, b, *peaks[j]) for j, (a, b) in enumerate(bounds)), balance


def plan(
    profile: Profile,
    *,
    devices: int,
    batch_size: int,
    memory_limit_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    schedule: str | None = None,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    stages: Sequence[int] | None = None,
    top: int = 5,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Plan:
    """Choose P × D, N and the partition with the smallest modelled step time that fits.

    Every P dividing ``devices`` (at most one stage per layer) is paired with D = devices / P
    replicas, each taking ``batch_size / D`` samples per step in N microbatches (N from
    ``microbatches``, dividing the per-replica batch). For each, dynamic programming over
    contiguous ranges proposes cuts whose slowest stage is as fast as possible with every
    stage within ``memory_limit_bytes`` (PipeDream's optimizer), each is modelled with
    :func:`evaluate`, and the fastest is kept.

    Args:
        profile: from :func:`profile`, measured at the microbatch sizes the candidates need
            (or at two or more sizes, to interpolate).
        devices: devices available, P × D.
        batch_size: samples per optimiser step, over all replicas.
        memory_limit_bytes: per device; None: no limit.
        bandwidth_bytes_per_s: of the links between devices; None: communication is free.
        schedule: default: the profile's.
        microbatches: the N to try.
        stages: the P to try (default: every divisor of ``devices``).
        top: runner-ups to keep.
        tolerance: cuts modelled within this fraction of the fastest count as ties (the
            profile is measured, so it is noisy), and the most even in layers among them is
            taken; 0: the fastest as modelled.

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: no candidate layout fits the memory limit (the message says how much the
            leanest one needs), or none can be modelled.

    Example:
        >>> prof = profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
        ...                torch.randn(8, 8), microbatch_sizes=[2, 4, 8], repeats=2)
        >>> choice = plan(prof, devices=2, batch_size=8).best
        >>> choice.stages * choice.replicas
        2
    """
    schedule = _check_schedule(profile, schedule)
    _check_whole("devices", devices)
    _check_whole("batch_size", batch_size)
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes must be positive, got {memory_limit_bytes}")
    if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s must be positive, got {bandwidth_bytes_per_s}")
    most = profile.num_layers
    choices = [p for p in range(1, devices + 1) if devices % p == 0]
    if stages is not None:
        choices = [p for p in choices if p in set(stages)]
    fitted: list[Layout] = []
    skipped: list[str] = []
    leanest: tuple[float, str] | None = None
    for p in choices:
        d = devices // p
        if p > most:
            skipped.append(f"P={p}: more stages than the {most} the layers allow")
            continue
        if batch_size % d:
            skipped.append(f"P={p} D={d}: the batch of {batch_size} does not split into {d}")
            continue
        for n in sorted(set(microbatches)):
            if (batch_size // d) % n:
                continue
            m = batch_size // d // n
            where = f"P={p} D={d} N={n}"
            try:
                layers, input_bytes = profile.at(m)
            except ValueError:
                skipped.append(f"{where}: microbatch size {m} was not profiled")
                continue
            costs = _Costs(layers, input_bytes, profile, n, d, bandwidth_bytes_per_s)
            best = _best_layout(costs, schedule, p, memory_limit_bytes, tolerance, d, m)
            if best is None:
                need, _ = _least_memory(costs, schedule, p)
                skipped.append(f"{where}: needs {_size(need)} on its fullest stage")
                if leanest is None or need < leanest[0]:
                    leanest = (need, where)
                continue
            fitted.append(best)
    if not fitted:
        raise ValueError(_nothing_fits(memory_limit_bytes, leanest, skipped))
    fitted.sort(key=lambda lay: (lay.step_s, max(lay.memory_bytes)))
    return Plan(
        fitted[0],
        tuple(fitted[1 : 1 + top]),
        devices,
        memory_limit_bytes,
        bandwidth_bytes_per_s,
        len(fitted),
        tuple(skipped),
    )


def _nothing_fits(limit: int | None, leanest: tuple[float, str] | None, skipped: list[str]) -> str:
    if leanest is not None and limit is not None:
        need, where = leanest
        return (
            f"no layout fits the memory limit of {_size(limit)} per device: the leanest "
            f"({where}) needs {_size(need)} on its fullest stage. Raise the limit to at least "
            f"{_size(need)}, use more devices, a smaller batch or more microbatches"
        )
    shown = "; ".join(skipped[:4]) or "no (P, N) candidates"
    return (
        f"no layout could be modelled ({shown}); profile at the microbatch sizes the "
        "candidates need, or pass other devices, batch_size or microbatches"
    )


def auto_balance(
    seq: nn.Sequential,
    sample: Any,
    stages: int,
    microbatches: int,
    schedule: str = "pipemare",
    *,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: OptimizerFactory = torch.optim.Adam,
    config: PipeMareConfig | None = None,
    memory_limit_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    forward_context: ForwardContext | None = None,
    repeats: int = 5,
    rounds: int = 3,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[int]:
    """The planner's partition for a fixed P and N: what ``balance="auto"`` uses.

    Profiles ``seq`` on ``sample`` (one microbatch, as the strategy times layers for
    ``balance="time"``) with :func:`profile` and cuts it with the planner's dynamic
    programme: the slowest stage's modelled time per step (N forward and backward passes and
    the update, engine costs included) is as small as possible and every stage's modelled
    memory is within ``memory_limit_bytes``. The cut may fall between layers that share a
    parameter: the engine keeps the tie's copies in step (:mod:`pipemare.engine.ties`).

    Args:
        seq: the layers.
        sample: one microbatch of the model's input.
        stages: P.
        microbatches: N.
        schedule: the schedule that will run.
        target: what ``loss_fn`` compares the output with, for one microbatch.
        loss_fn: ``(output, target) -> loss``; default: the output's sum.
        optimizer: builds the optimiser from parameters (its step is timed, its state counted).
        config: the corrections' settings (default: the schedule's).
        memory_limit_bytes: per device; None: no limit.
        bandwidth_bytes_per_s: of the links between stages; None: free.
        forward_context: a context manager factory around each forward (e.g. autocast).
        repeats: timed steps of the profile per round.
        rounds: rounds of the profile (see :func:`profile`).
        tolerance: cuts within this fraction of the fastest count as ties, and the most even
            in layers among them is taken (see :func:`plan`).

    Returns:
        Layers per stage, ``stages`` positive counts summing to ``len(seq)``.

    Raises:
        ValueError: ``stages`` does not fit the layers, or no cut fits the memory limit.

    Example:
        >>> seq = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        >>> balance = auto_balance(seq, torch.randn(4, 16), stages=2, microbatches=2, repeats=2)
        >>> len(balance), sum(balance)  # the cut itself follows measured times
        (2, 4)
    """
    partition.check_sequential(seq)
    partition.even_balance(len(seq), stages)  # refuses impossible stage counts
    _check_whole("microbatches", microbatches)
    if stages == 1:
        return [len(seq)]
    prof = profile(
        seq,
        sample,
        target=target,
        loss_fn=loss_fn,
        optimizer=optimizer,
        schedule=schedule,
        config=config,
        repeats=repeats,
        rounds=rounds,
        forward_context=forward_context,
    )
    return best_cut(
        prof,
        stages,
        microbatches,
        schedule,
        memory_limit_bytes=memory_limit_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        tolerance=tolerance,
    )


def best_cut(
    prof: Profile,
    stages: int,
    microbatches: int,
    schedule: str = "pipemare",
    microbatch_size: int | None = None,
    *,
    memory_limit_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[int]:
    """The planner's cut of profiled layers for a fixed P and N (no measuring: see
    :func:`auto_balance`).

    Args:
        prof: the layers' profile (:func:`profile`).
        stages: P.
        microbatches: N.
        schedule: the schedule that will run.
        microbatch_size: rows of a microbatch (default: the profile's first size).
        memory_limit_bytes: per device; None: no limit.
        bandwidth_bytes_per_s: of the links between stages; None: free.
        tolerance: cuts within this fraction of the fastest count as ties (see :func:`plan`).

    Raises:
        ValueError: no cut fits the memory limit.
    """
    if stages == 1:
        return [prof.num_layers]
    size = prof.sizes[0] if microbatch_size is None else microbatch_size
    layers, input_bytes = prof.at(size)
    costs = _Costs(layers, input_bytes, prof, microbatches, 1, bandwidth_bytes_per_s)
    best = _best_layout(costs, schedule, stages, memory_limit_bytes, tolerance, 1, size)
    if best is None:
        assert memory_limit_bytes is not None
        need, _ = _least_memory(costs, schedule, stages)
        raise ValueError(
            f"no cut of {prof.num_layers} layers into {stages} stages fits "
            f"{_size(memory_limit_bytes)} per device: the leanest needs {_size(need)} on its "
            "fullest stage; raise the limit, use more stages or more, smaller microbatches"
        )
    return list(best.balance)
