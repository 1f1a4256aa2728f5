"""Timing stages as the engine runs them: per-layer hooks inside a real pipeline, the loss, and
each layer's share of an update.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.engine.telemetry import replay_timeline
from pipemare.model.partition import _flat, _layers, head_passes, layer_passes
from pipemare.optim.config import PipeMareConfig
from pipemare.planner.measurements import ForwardContext, OptimizerFactory
from pipemare.planner.saved_bytes import _first_holders, _nbytes, _sum_loss
from pipemare.schedule.actions import spec

# forward, backward and update seconds of one layer (or stage), one entry per timed action
_Samples = tuple[list[float], list[float], list[float]]


def _empty() -> _Samples:
    return [], [], []


def _extend(into: _Samples, samples: _Samples) -> None:
    for kind in range(3):
        into[kind].extend(samples[kind])


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _medians(samples: _Samples) -> tuple[float, float, float]:
    f, b, u = (_median(v) for v in samples)
    return f, b, u


@dataclasses.dataclass(frozen=True)
class _Training:
    """How every timed run trains: the loss, the optimiser, the schedule and its corrections'
    settings, the timed steps and the context around each forward."""

    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: OptimizerFactory
    schedule: str
    config: PipeMareConfig | None
    repeats: int
    forward_context: ForwardContext | None = None


class _Runs:
    """What the timed stage runs measured, pooled over rounds, for one microbatch size.

    ``delayed`` holds the two-stage run's first stage, ``undelayed`` the one-stage run: per
    layer its forward and backward seconds (hooks), per run-stage its action seconds.
    """

    def __init__(self, layers: int) -> None:
        self.layers = {d: [_empty() for _ in range(layers)] for d in (True, False)}
        self.stage = {d: _empty() for d in (True, False)}
        self.span = {True: 0, False: layers}  # layers 0..span-1 ran in the run-stage
        self.state = [0] * layers


def _last_cut(seq: nn.Sequential) -> int:
    """The last place a stage may start, or 0 if none."""
    return max(len(seq) - 1, 0)


def _time_stages(seq: nn.Sequential, batch: Any, training: _Training, runs: _Runs) -> None:
    """Run a copy of ``seq`` as one stage, and (non-flushing) as two; time layers and actions."""
    cut = _last_cut(seq)
    layouts = [(False, [len(seq)])]
    if not spec(training.schedule).flushes and cut > 0:
        layouts.append((True, [cut, len(seq) - cut]))
        runs.span[True] = cut
    for delayed, balance in layouts:
        model = copy.deepcopy(seq)
        clock = _LayerClock(model)
        actions, pipe = _time_engine(model, batch, training, balance, clock)
        clock.close()
        _extend(runs.stage[delayed], actions[0])
        for i in range(balance[0]):
            runs.layers[delayed][i][0].extend(clock.forward[i])
            runs.layers[delayed][i][1].extend(clock.backward[i])
        if delayed or len(layouts) == 1:  # the delayed stage holds the corrections' buffers
            runs.state = _state_bytes(model, pipe)


class _LayerClock:
    """Times each layer's forward and backward passes inside the engine's stage actions.

    Forward: from the layer's pre-hook to its hook. Backward: from the moment the gradient
    of its output exists to the last of its input's gradient and its parameters' gradient
    accumulations. One backward pass of a layer runs at a time, so events pair up in order.
    """

    def __init__(self, seq: nn.Sequential) -> None:
        layers = _layers(seq)
        self.forward: list[list[float]] = [[] for _ in layers]
        self.backward: list[list[float]] = [[] for _ in layers]
        self._began: dict[int, float] = {}
        self._ends: dict[int, bool] = {}  # whether this forward's backward will signal its end
        self._open: dict[int, list[float]] = {}  # layer -> [start, end] of its backward
        self._handles: list[Any] = []
        self._trains = [any(p.requires_grad for p in own) for own in _first_holders(seq)]
        for i, ((_, layer), own) in enumerate(zip(layers, _first_holders(seq), strict=True)):
            self._handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.register_forward_hook(self._post(i)))
            for p in own:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._end(i)))

    def reset(self) -> None:
        """Forget what was timed so far (the warm-up)."""
        for times in (*self.forward, *self.backward):
            times.clear()
        self._open.clear()

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._ends[i] = self._trains[i]
            if torch.is_grad_enabled():
                for t in _flat(args):
                    if t.requires_grad:
                        t.register_hook(self._end(i))
                        self._ends[i] = True
            self._began[i] = time.perf_counter()

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.forward[i].append(time.perf_counter() - self._began[i])
            if torch.is_grad_enabled() and self._ends[i]:
                for t in _flat(output):
                    if t.requires_grad:
                        t.register_hook(self._start(i))

        return hook

    def _start(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            now = time.perf_counter()
            span = self._open.get(i)
            if span is not None and span[1] > span[0]:  # the previous pass of this layer ended
                self.backward[i].append(span[1] - span[0])
                span = None
            if span is None:  # (several outputs: the first gradient starts the pass)
                self._open[i] = [now, now]

        return hook

    def _end(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            span = self._open.get(i)
            if span is not None:
                span[1] = max(span[1], time.perf_counter())

        return hook

    def close(self) -> None:
        for i, span in self._open.items():
            if span[1] > span[0]:
                self.backward[i].append(span[1] - span[0])
        self._open.clear()
        for handle in self._handles:
            handle.remove()


def _state_bytes(seq: nn.Sequential, pipe: Any) -> list[int]:
    """Per layer: optimiser state and correction buffers held for its own parameters."""
    owner = {id(p): i for i, own in enumerate(_first_holders(seq)) for p in own}
    held = [0] * len(seq)
    for p, st in pipe.optimizer.optimizer.state.items():
        if id(p) in owner:
            held[owner[id(p)]] += _nbytes(list(st.values()))
    for correction in pipe.optimizer.corrections:
        for p, buffer in correction.buffers().items():
            if id(p) in owner:
                held[owner[id(p)]] += _nbytes(buffer)
    return held


def _time_engine(
    model: nn.Sequential,
    batch: Any,
    training: _Training,
    balance: list[int],
    clock: _LayerClock | None = None,
) -> tuple[list[_Samples], Any]:
    """Engine seconds of each stage's forward, backward and update actions (N = 1)."""
    from pipemare.engine.pipeline import (
        Pipeline,
    )  # the pipeline imports much; only profiling needs it
    from pipemare.engine.telemetry import Probe

    stages = len(balance)
    opt = training.optimizer(model.parameters())
    for group in opt.param_groups:  # the same work per step, and the copy cannot diverge
        group["lr"] = 0.0
    pipe = Pipeline(
        model,
        opt,
        training.loss,
        stages=stages,
        microbatches=1,
        schedule=training.schedule,
        balance=balance,
        config=training.config,
        forward_context=training.forward_context,
        seed=0,
        check_finite=True,  # as in training: the check costs time at every update
    )
    for _ in range(stages + 2):  # fill the pipeline and warm the caches up
        pipe.step(batch)
    if clock is not None:
        clock.reset()
    probe = Probe(timeline=True)
    pipe.probe = probe
    for _ in range(training.repeats):
        pipe.step(batch)
    pipe.probe = None
    replayed, _ = replay_timeline(probe.take_spans(), stages)  # durations without comm
    samples = [_empty() for _ in range(stages)]
    for stage, name, _, start, end in replayed:
        if name in ("F", "B", "U"):
            samples[stage]["FBU".index(name)].append(end - start)
    pipe.drain()
    return samples, pipe


def _time_loss(
    seq: nn.Sequential, sample: Any, target: Any, training: _Training
) -> tuple[float, float]:
    """Median seconds of the loss's forward and of its backward into the model's output, timed
    as :func:`~pipemare.model.partition.head_passes` times a head, on the wall clock the
    engine's actions here are timed on; under the run's forward context, as the last stage
    runs it."""
    enter = training.forward_context
    with enter() if enter is not None else contextlib.nullcontext():
        return head_passes(
            lambda out: training.loss(out, target),
            seq,
            sample,
            repeats=training.repeats,
            clock=time.perf_counter,
        )


def _time_updates(seq: nn.Sequential, batch: Any, training: _Training) -> list[list[float]]:
    """Per layer, update seconds with each layer a stage of its own: how a stage update's
    work is shared out between its layers (per parameter tensor and per byte, corrections
    included; a tied weight's update is timed on its first holder, which owns it)."""
    units = [1] * len(seq)
    plain = dataclasses.replace(training, forward_context=None)
    actions, _ = _time_engine(copy.deepcopy(seq), batch, plain, units)
    out: list[list[float]] = []
    for unit, count in zip(actions, units, strict=True):
        out += [unit[2]] + [[0.0] for _ in range(count - 1)]
    return out


class _Scalar(nn.Module):
    """A trivial layer (one weight, one multiply): what the engine costs besides the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Scalars(nn.Module):
    """A trivial layer of ``count`` weights, one scalar each: what a stage's update costs per
    tensor it trains, beside :class:`_Scalar`'s one."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(1)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = x * weight
        return x


#: weights a layer of the per-tensor calibration holds (:func:`_calibrate`'s ``weights``)
TENSORS_PER_LAYER = 16


def _scalars_own_per_tensor(device: torch.device, repeats: int = 21) -> tuple[float, float]:
    """Seconds per weight beyond the first that :class:`_Scalars`' own forward and backward
    take (a multiply each), timed alone as :func:`~pipemare.model.partition.layer_passes`
    times a model's layers: what the per-tensor calibration's actions hold besides the
    engine's own work per tensor."""
    x = torch.ones(1, 1, device=device)
    ((one_f, one_b),) = layer_passes(nn.Sequential(_Scalar().to(device)), x, repeats)
    many = nn.Sequential(_Scalars(TENSORS_PER_LAYER).to(device))
    ((many_f, many_b),) = layer_passes(many, x, repeats)
    beyond = TENSORS_PER_LAYER - 1
    return max(many_f - one_f, 0.0) / beyond, max(many_b - one_b, 0.0) / beyond


def _calibration_training(training: _Training) -> _Training:
    """How the calibration pipelines train: ``training``'s optimiser, schedule and corrections,
    a plain sum for the loss, no forward context, at least ten timed steps."""
    return dataclasses.replace(
        training, loss=_sum_loss, repeats=max(training.repeats, 10), forward_context=None
    )


#: widths of :func:`_calibrate_dense`'s layers, a factor of about sqrt(2) apart: its stand-in
#: stage is the one nearest (in log) the run's stage in parameters, within this range. The
#: update's cost per parameter grows with the weights' size on a CPU, as they and the optimiser's
#: state outgrow the caches (AdamW with pipemare's corrections, one thread, this project's CI
#: machine, beyond the fixed cost: 5.8 ns a parameter at width 512, 7.3-9.2 at 1,448).
DENSE_WIDTHS = (256, 362, 512, 724, 1024, 1448)


def dense_width(stage_params: int | None) -> int:
    """The width of :func:`_calibrate_dense`'s layers for stages of about ``stage_params``
    trained parameters (512 where unknown).

    Example:
        >>> dense_width(None), dense_width(1_770_000), dense_width(1), dense_width(10**9)
        (512, 1448, 256, 1448)
    """
    if stage_params is None:
        return 512
    root = max(stage_params, 1) ** 0.5
    return min(DENSE_WIDTHS, key=lambda w: abs(math.log(w / root)))


def _calibrate_dense(
    training: _Training, device: torch.device, width: int = 512
) -> tuple[float, float, float, int]:
    """Stages holding one ``Linear(width, width)`` each, timed as :func:`_calibrate` times its
    scalar layers: a delayed stage's forward seconds beyond the layer's own (timed alone, as
    :func:`~pipemare.model.partition.layer_passes` times a model's layers), its update's
    seconds, the last stage's update seconds (no delay), and the layer's parameter count. What
    the engine does per parameter around a forward (weight prediction) and in an update (the
    optimiser and the corrections) on a typical dense weight; a weight of the same size read
    one element at a time updates about twice as slowly (measured on the CPU), so the stand-in
    is a layer of the kind models hold. Three layers, one a stage: the middle one is delayed
    and is not the last."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(3)]).to(device)
    x = torch.ones(1, width, device=device)
    trivial = _calibration_training(training)
    times, _ = _time_engine(model, (x, torch.zeros(1, device=device)), trivial, [1] * 3)
    forward, _, update = _medians(times[1])
    last_update = _median(times[2][2])
    ((own, _),) = layer_passes(nn.Sequential(model[1]), x)
    params = sum(p.numel() for p in model[1].parameters())
    return max(forward - own, 0.0), update, last_update, params


def _calibrate(
    training: _Training, device: torch.device, hooked: bool = True, weights: int = 1
) -> list[tuple[str, _Samples]]:
    """The engine's fixed seconds per action: a pipeline of trivial layers, whose middle
    stages (delayed) and last stage (no delay; it hands the loss over) do next to nothing;
    and, with ``hooked``, the middle stages again with :class:`_LayerClock`'s hooks on (a
    second pipeline run, which only a profile of the layers needs). With ``weights`` > 1
    each layer holds that many scalar weights (:class:`_Scalars`): what an action adds per
    tensor it trains."""
    layers = [_Scalar() if weights == 1 else _Scalars(weights) for _ in range(5)]
    model = nn.Sequential(*layers).to(device)
    x = torch.ones(1, 1, device=device)
    batch = (x, torch.zeros(1, device=device))
    trivial = _calibration_training(training)
    times, _ = _time_engine(model, batch, trivial, [1] * 5)
    out = [("delayed", t) for t in times[1:4]] + [("undelayed", times[4])]
    if not hooked:
        return out
    clocked = copy.deepcopy(model)
    clock = _LayerClock(clocked)  # what the layer hooks themselves cost, to take it out
    with_hooks, _ = _time_engine(clocked, batch, trivial, [1] * 5, clock)
    clock.close()
    return out + [("hooked", t) for t in with_hooks[1:4]]
