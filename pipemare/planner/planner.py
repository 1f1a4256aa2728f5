"""Choosing the layout: stages P × replicas D, microbatches N and the partition, from a profile.

The planner works in three steps, after PipeDream's optimizer and BaPipe's exploration:

1. :func:`profile` measures every layer of an ``nn.Sequential`` on this device: the seconds
   it adds to a stage's forward, backward and update actions as the engine runs them (the
   engine's own per-action work, the corrections and the optimiser wrapper included), the
   bytes it sends to the next stage, the bytes autograd saves for its backward pass, and its
   parameter, gradient and optimiser-state bytes.
2. :func:`evaluate` models one layout: a stage's time is the sum of its layers' (with the
   fixed per-action cost counted once), the schedule's action streams are replayed through
   their dependencies with :func:`pipemare.engine.telemetry.replay_timeline` (the same replay that
   turns a measured run into pipeline time), and memory per stage counts parameters,
   gradients, optimiser state, saved activations times the microbatches the schedule keeps
   in flight on that stage, and stashed weight versions.
3. :func:`plan` enumerates P dividing the device count (D = devices / P) and N dividing the
   per-replica batch, cuts the layers by dynamic programming over contiguous ranges that
   minimises the slowest stage within the memory limit, models each candidate and returns
   the fastest with its runner-ups.

``pipemare plan --config CONFIG.yaml`` runs all three on a LightningCLI config.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import dataclasses
import math
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from pipemare.engine.microbatch import _map, batch_size
from pipemare.engine.telemetry import Span, replay_timeline
from pipemare.model import partition
from pipemare.model.partition import _flat, _joined, _layers, _leaf
from pipemare.optim.config import PipeMareConfig
from pipemare.schedule.actions import Op, generate, spec

__all__ = [
    "LayerProfile",
    "Layout",
    "Overhead",
    "Plan",
    "Profile",
    "auto_balance",
    "evaluate",
    "main",
    "parse_bytes",
    "plan",
    "profile",
    "steady_step_time",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
ForwardContext = Callable[[], contextlib.AbstractContextManager[Any]]

#: Microbatch counts :func:`plan` tries by default.
DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)

#: Layouts modelled within this fraction of the fastest are ties, won by the most even cut.
DEFAULT_TOLERANCE = 0.01


# -- what a profile holds -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer at one microbatch size.

    Times are what the layer adds to a stage's action in the engine, on top of the action's
    fixed cost (:class:`Overhead`); communication is excluded.

    Attributes:
        name: the layer's name in the Sequential.
        forward_s: seconds it adds to a forward action of a delayed stage (one that is not
            the last of a non-flushing pipeline); the last layer's include the loss.
        backward_s: seconds it adds to a backward action.
        update_s: seconds it adds to an update action (its share of the optimiser step).
        output_bytes: bytes of its output, what a stage ending here sends on (the gradient
            coming back has the same size).
        saved_bytes: bytes autograd saves for its backward pass, other than its input and its
            output (parameters excluded: the engine saves them by reference).
        saves_input: whether autograd keeps its input alive for the backward pass.
        saves_output: whether autograd keeps its output alive (or the loss keeps it).
        param_bytes: bytes of its parameters (a tied parameter counts at its first layer).
        grad_bytes: bytes of the gradients of its trainable parameters.
        state_bytes: bytes of optimiser state and correction buffers for its parameters.
        undelayed: forward, backward and update seconds it adds on a stage without delay,
            the last stage of a non-flushing pipeline, where corrections and weight stashing
            have nothing to do; None: the same as above (flushing schedules).
    """

    name: str
    forward_s: float
    backward_s: float
    update_s: float
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    undelayed: tuple[float, float, float] | None = None

    def times(self, delayed: bool = True) -> tuple[float, float, float]:
        """Forward, backward and update seconds on a delayed stage (or the undelayed one)."""
        if delayed or self.undelayed is None:
            return self.forward_s, self.backward_s, self.update_s
        return self.undelayed


@dataclasses.dataclass(frozen=True)
class Overhead:
    """The engine's fixed seconds per action, whatever the layers: a stage pays them once.

    Measured on a pipeline of trivial layers (one scalar weight each) with the same schedule
    and optimiser; a stage's action costs this plus what each of its layers adds.
    """

    forward_s: float
    backward_s: float
    update_s: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs of a model, measured at one or more microbatch sizes.

    Attributes:
        schedule: the schedule the times were measured under (its corrections cost time).
        sizes: the microbatch sizes measured, ascending.
        layers: per size, one :class:`LayerProfile` per layer.
        input_bytes: per size, bytes of the model's input.
        overhead: the engine's fixed per-action seconds on a stage other than the last.
        joined: layer indices where no stage may start (tied weights).
        undelayed_overhead: the fixed per-action seconds of the last stage (no delay; it also
            hands the loss over); None: the same as ``overhead``.
    """

    schedule: str
    sizes: tuple[int, ...]
    layers: tuple[tuple[LayerProfile, ...], ...]
    input_bytes: tuple[int, ...]
    overhead: Overhead
    joined: frozenset[int] = frozenset()
    undelayed_overhead: Overhead | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers[0])

    def at(self, microbatch_size: int) -> tuple[tuple[LayerProfile, ...], int]:
        """The layers' costs and the input's bytes at ``microbatch_size`` samples.

        A measured size is returned as measured; a size between two measured ones is
        interpolated linearly between them (times and activations grow about linearly with
        the samples). Sizes outside the measured range are refused, not extrapolated.

        Raises:
            ValueError: the size lies outside the measured range.
        """
        if microbatch_size in self.sizes:
            j = self.sizes.index(microbatch_size)
            return self.layers[j], self.input_bytes[j]
        if not self.sizes[0] < microbatch_size < self.sizes[-1]:
            raise ValueError(
                f"the profile was measured at microbatch sizes {list(self.sizes)}, not "
                f"{microbatch_size}; profile with microbatch_sizes=[..., {microbatch_size}] "
                "(sizes between two measured ones are interpolated)"
            )
        hi = bisect.bisect_left(self.sizes, microbatch_size)
        lo = hi - 1
        w = (microbatch_size - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        layers = tuple(
            _blend(a, b, w) for a, b in zip(self.layers[lo], self.layers[hi], strict=True)
        )
        inputs = round(_lerp(self.input_bytes[lo], self.input_bytes[hi], w))
        return layers, max(inputs, 0)


def _lerp(a: float, b: float, w: float) -> float:
    return a + (b - a) * w


def _blend(a: LayerProfile, b: LayerProfile, w: float) -> LayerProfile:
    near = a if w < 0.5 else b

    def time(x: float, y: float) -> float:
        return max(_lerp(x, y, w), 0.0)

    def size(x: int, y: int) -> int:
        return max(round(_lerp(x, y, w)), 0)

    undelayed = None
    if a.undelayed is not None and b.undelayed is not None:
        f, bw, u = (time(x, y) for x, y in zip(a.undelayed, b.undelayed, strict=True))
        undelayed = (f, bw, u)
    return dataclasses.replace(
        near,
        forward_s=time(a.forward_s, b.forward_s),
        backward_s=time(a.backward_s, b.backward_s),
        update_s=time(a.update_s, b.update_s),
        output_bytes=size(a.output_bytes, b.output_bytes),
        saved_bytes=size(a.saved_bytes, b.saved_bytes),
        undelayed=undelayed,
    )


# -- profiling ----------------------------------------------------------------------------


def profile(
    seq: nn.Sequential,
    sample: Any,
    *,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: OptimizerFactory = torch.optim.Adam,
    schedule: str = "pipemare",
    config: PipeMareConfig | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    repeats: int = 5,
    rounds: int = 3,
    forward_context: ForwardContext | None = None,
) -> Profile:
    """Measure every layer of ``seq`` on this device, at each microbatch size.

    Times come from the engine itself, so its per-action work, the schedule's corrections
    and the optimiser wrapper are in them. A copy of ``seq`` runs in this process as one
    stage (P = 1: a stage without delay, as the last stage of any pipeline) and, for the
    non-flushing schedules, as two stages cut before the last layer (the first stage then has
    a delay and runs the corrections). Hooks time each layer's forward and backward inside
    those stage actions; what the actions take beyond their layers is the engine's fixed cost
    per action (measured apart, on a pipeline of trivial layers) plus work in proportion to
    the parameters (weight prediction, corrections, the update), which is shared out by
    parameter bytes and, for the update, by each layer's update time in a pipeline of one
    layer per stage (per tensor and per byte costs alike). So a stage of any layers
    costs the fixed part once plus what each of its layers adds. The loss is timed on its
    own and added to the last layer. Medians of ``rounds × repeats`` steps after warm-up.

    Bytes come from one forward pass per layer under ``saved_tensors_hooks``; optimiser state
    and correction buffers from the engine's optimiser after those steps. Run it alone on the
    machine, with the thread count the training will use: the durations are measured.

    Args:
        seq: the layers; not changed (copies are trained for the timings).
        sample: the model's input with at least ``max(microbatch_sizes)`` samples along dim 0.
        target: what ``loss_fn`` compares the output with (same number of samples), if any.
        loss_fn: ``(output, target) -> loss``, timed with the last layer; default: the sum of
            the output (the backward pass then starts from ones, as without a loss).
        optimizer: builds the optimiser from parameters, e.g. ``torch.optim.Adam`` or
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        schedule: the schedule the layout will run (its corrections take time and memory).
        config: the corrections' settings (default: the schedule's).
        microbatch_sizes: samples per microbatch to measure at (default: all of ``sample``);
            :meth:`Profile.at` interpolates between them.
        repeats: timed steps per size and round.
        rounds: time every size this many times in turn, so that a passing load on the
            machine does not hit one size alone; the medians pool all rounds.
        forward_context: a context manager factory around each forward (e.g. autocast).

    Returns:
        The :class:`Profile`.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> prof = profile(seq, torch.randn(4, 8), repeats=2)
        >>> [layer.param_bytes for layer in prof.layers[0]]
        [576, 0, 272]
    """
    partition.check_sequential(seq)
    spec(schedule)
    if repeats < 1 or rounds < 1:
        raise ValueError(f"repeats and rounds must be at least 1, got {repeats} and {rounds}")
    rows = batch_size(sample)
    sizes = sorted(set(microbatch_sizes)) if microbatch_sizes is not None else [rows]
    if not sizes or sizes[0] < 1 or sizes[-1] > rows:
        raise ValueError(
            f"microbatch_sizes {list(microbatch_sizes or [])} must be whole numbers from 1 to "
            f"the sample's {rows} samples; pass a larger sample or smaller sizes"
        )
    if target is not None and batch_size(target) < sizes[-1]:
        raise ValueError(f"target has fewer samples than the largest microbatch size {sizes[-1]}")
    loss = loss_fn or _sum_loss
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.random.fork_rng(devices=[]),
    ):
        device = _device_of(seq, sample)
        batches = [
            (_rows(sample, m), _rows(target, m) if target is not None else torch.zeros(m))
            for m in sizes
        ]
        fixed = {name: _empty() for name in ("delayed", "undelayed", "hooked")}
        runs = [_Runs(len(seq)) for _ in sizes]
        updates: list[list[float]] = [[] for _ in seq]
        for _ in range(rounds):
            for name, samples in _calibrate(schedule, optimizer, config, repeats, device):
                _extend(fixed[name], samples)
            for i, seconds in enumerate(
                _time_updates(seq, batches[0], loss, optimizer, schedule, config, repeats)
            ):
                updates[i] += seconds
            for k, batch in enumerate(batches):
                _time_stages(seq, batch, loss, optimizer, schedule, config, repeats,
                             forward_context, runs[k])  # fmt: skip
        weights = [max(_median(u) - _median(fixed["delayed"][2]), 0.0) for u in updates]
        per_size, inputs = [], []
        for k, (x, t) in enumerate(batches):
            sizes_bytes, in_bytes = _bytes_pass(seq, x, t, loss_fn, forward_context)
            loss_times = _time_loss(seq, x, t, loss, repeats, forward_context)
            per_size.append(
                _records(seq, sizes_bytes, runs[k], fixed, weights, loss_times, schedule)
            )
            inputs.append(in_bytes)
    return Profile(
        schedule,
        tuple(sizes),
        tuple(per_size),
        tuple(inputs),
        Overhead(*_medians(fixed["delayed"])),
        frozenset(_joined(seq)),
        Overhead(*_medians(fixed["undelayed"])),
    )


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
    """The last place a stage may start (tied weights joined), or 0 if none."""
    joined = _joined(seq)
    return max((c for c in range(1, len(seq)) if c not in joined), default=0)


def _time_stages(
    seq: nn.Sequential,
    batch: Any,
    loss: Callable[[Any, Any], torch.Tensor],
    optimizer: OptimizerFactory,
    schedule: str,
    config: PipeMareConfig | None,
    repeats: int,
    forward_context: ForwardContext | None,
    runs: _Runs,
) -> None:
    """Run a copy of ``seq`` as one stage, and (non-flushing) as two; time layers and actions."""
    cut = _last_cut(seq)
    layouts = [(False, [len(seq)])]
    if not spec(schedule).flushes and cut > 0:
        layouts.append((True, [cut, len(seq) - cut]))
        runs.span[True] = cut
    for delayed, balance in layouts:
        model = copy.deepcopy(seq)
        clock = _LayerClock(model)
        actions, pipe = _time_engine(
            model,
            batch,
            loss,
            optimizer,
            schedule,
            config,
            balance,
            repeats,
            forward_context,
            clock,
        )
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
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: OptimizerFactory,
    schedule: str,
    config: PipeMareConfig | None,
    balance: list[int],
    repeats: int,
    forward_context: ForwardContext | None,
    clock: _LayerClock | None = None,
) -> tuple[list[_Samples], Any]:
    """Engine seconds of each stage's forward, backward and update actions (N = 1)."""
    from pipemare.engine.pipeline import (
        Pipeline,
    )  # the pipeline imports much; only profiling needs it
    from pipemare.engine.telemetry import Probe

    stages = len(balance)
    opt = optimizer(model.parameters())
    for group in opt.param_groups:  # the same work per step, and the copy cannot diverge
        group["lr"] = 0.0
    pipe = Pipeline(
        model,
        opt,
        loss_fn,
        stages=stages,
        microbatches=1,
        schedule=schedule,
        balance=balance,
        config=config,
        forward_context=forward_context,
        seed=0,
        check_finite=True,  # as in training: the check costs time at every update
    )
    for _ in range(stages + 2):  # fill the pipeline and warm the caches up
        pipe.step(batch)
    if clock is not None:
        clock.reset()
    probe = Probe(timeline=True)
    pipe.probe = probe
    for _ in range(repeats):
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
    seq: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    repeats: int,
    forward_context: ForwardContext | None,
) -> tuple[float, float]:
    """Median seconds of the loss's forward and backward on the model's output."""
    with torch.no_grad():
        output = seq(sample)
    forward, backward = [], []
    for _ in range(repeats + 2):
        out = _leaf(output)
        context = forward_context() if forward_context is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with context:
            value = loss_fn(out, target)
        middle = time.perf_counter()
        if value.requires_grad:
            value.backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return _median(forward[2:]), _median(backward[2:])


def _time_updates(
    seq: nn.Sequential,
    batch: Any,
    loss: Callable[[Any, Any], torch.Tensor],
    optimizer: OptimizerFactory,
    schedule: str,
    config: PipeMareConfig | None,
    repeats: int,
) -> list[list[float]]:
    """Per layer, update seconds with each layer a stage of its own (layers sharing weights
    together, timed on the first): how a stage update's work is shared out between its
    layers (per parameter tensor and per byte, corrections included)."""
    units: list[int] = []
    joined = _joined(seq)
    for i in range(len(seq)):
        if i in joined and units:
            units[-1] += 1
        else:
            units.append(1)
    actions, _ = _time_engine(
        copy.deepcopy(seq), batch, loss, optimizer, schedule, config, units, repeats, None
    )
    out: list[list[float]] = []
    for unit, count in zip(actions, units, strict=True):
        out += [unit[2]] + [[0.0] for _ in range(count - 1)]
    return out


def _share(total: float, weights: Sequence[float]) -> list[float]:
    """``total`` shared in proportion to ``weights`` (equally when they are all zero)."""
    mass = sum(weights)
    if mass <= 0:
        return [total / len(weights)] * len(weights) if weights else []
    return [total * w / mass for w in weights]


def _marginals(
    runs: _Runs,
    delayed: bool,
    fixed: tuple[float, float, float],
    hooking: tuple[float, float],
    params: Sequence[float],
    weights: Sequence[float],
    loss: tuple[float, float],
) -> list[tuple[float, float, float]]:
    """What each layer adds to a stage's forward, backward and update seconds.

    A stage's action beyond its layers' hooked times, the fixed cost, the hooks' own cost
    and the loss is work in proportion to the parameters (weight prediction, corrections),
    shared out by parameter bytes; the update by each layer's update time of its own.
    """
    span = runs.span[delayed]
    hooks = [_medians(runs.layers[delayed][i]) for i in range(span)]
    action = _medians(runs.stage[delayed])
    last = not delayed  # the one-stage run also computed the loss
    rest = [
        action[k] - sum(h[k] for h in hooks) - (loss[k] if last else 0.0) - fixed[k]
        - span * hooking[k]
        for k in range(2)
    ] + [action[2] - fixed[2]]  # fmt: skip
    f = _share(max(rest[0], 0.0), params[:span])
    b = _share(max(rest[1], 0.0), params[:span])
    u = _share(max(rest[2], 0.0), weights[:span] if sum(weights[:span]) > 0 else params[:span])
    out = [(h[0] + f[i], h[1] + b[i], u[i]) for i, h in enumerate(hooks)]
    if last and out:
        lf, lb, lu = out[-1]
        out[-1] = (lf + loss[0], lb + loss[1], lu)
    return out


def _records(
    seq: nn.Sequential,
    sizes: list[_Bytes],
    runs: _Runs,
    fixed: dict[str, _Samples],
    weights: list[float],
    loss: tuple[float, float],
    schedule: str,
) -> tuple[LayerProfile, ...]:
    params = [float(b.grads) for b in sizes]
    plain, hooked = _medians(fixed["delayed"]), _medians(fixed["hooked"])
    hooking = (max(hooked[0] - plain[0], 0.0), max(hooked[1] - plain[1], 0.0))
    undelayed = _marginals(
        runs, False, _medians(fixed["undelayed"]), hooking, params, weights, loss
    )
    delayed = undelayed
    if not spec(schedule).flushes and runs.span[True] > 0:
        head = _marginals(runs, True, plain, hooking, params, weights, (0.0, 0.0))
        delayed = head + undelayed[len(head) :]  # later layers are only ever in the last stage
    flushes = spec(schedule).flushes
    return tuple(
        LayerProfile(
            name,
            *delayed[i],
            output_bytes=sizes[i].output,
            saved_bytes=sizes[i].saved,
            saves_input=sizes[i].saves_input,
            saves_output=sizes[i].saves_output,
            param_bytes=sizes[i].params,
            grad_bytes=sizes[i].grads,
            state_bytes=runs.state[i],
            undelayed=None if flushes else undelayed[i],
        )
        for i, (name, _) in enumerate(_layers(seq))
    )


def _device_of(seq: nn.Sequential, sample: Any) -> torch.device:
    first = next(seq.parameters(), None)
    if first is not None:
        return first.device
    tensors = _flat(sample)
    return tensors[0].device if tensors else torch.device("cpu")


def _rows(value: Any, n: int) -> Any:
    return _map(value, lambda t: t[:n] if t.dim() > 0 else t)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(value))


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _flat(value)}


class _Bytes(NamedTuple):
    output: int
    saved: int
    saves_input: bool
    saves_output: bool
    params: int
    grads: int


def _bytes_pass(
    seq: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    forward_context: ForwardContext | None,
) -> tuple[list[_Bytes], int]:
    """Per layer its bytes, and the bytes of the model's input."""
    params = {id(p) for p in seq.parameters()}
    seen: set[int] = set()
    out_rows: list[_Bytes] = []
    layers = _layers(seq)
    x = sample
    for i, (_, layer) in enumerate(layers):
        saved: dict[int, int] = {}
        leaf = _leaf(x)
        context = forward_context() if forward_context is not None else contextlib.nullcontext()
        with _counting(saved, params), context:
            out = layer(leaf)
            if i == len(layers) - 1 and loss_fn is not None:
                loss_fn(out, target)
        ins, outs = _storages(leaf), _storages(out)
        other = sum(n for ptr, n in saved.items() if ptr not in ins | outs and ptr != 0)
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        out_rows.append(
            _Bytes(
                _nbytes(out),
                other,
                bool(ins & set(saved)),
                bool(outs & set(saved)),
                sum(p.numel() * p.element_size() for p in own),
                sum(p.numel() * p.element_size() for p in own if p.requires_grad),
            )
        )
        x = _detach(out)
    return out_rows, _nbytes(sample)


def _counting(saved: dict[int, int], params: set[int]) -> contextlib.AbstractContextManager[Any]:
    """Record the storage and size of every tensor autograd saves, parameters excepted."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params and id(t) not in params:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _detach(value: Any) -> Any:
    return _map(value, lambda t: t.detach())


def _sum_loss(output: Any, _target: Any) -> torch.Tensor:
    """Stand-in loss: the sum of the output, so the backward pass starts from ones."""
    parts = [t.sum() for t in _flat(output) if t.is_floating_point()]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def _first_holders(seq: nn.Sequential) -> list[list[nn.Parameter]]:
    seen: set[int] = set()
    holders = []
    for _, layer in _layers(seq):
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        holders.append(own)
    return holders


class _Scalar(nn.Module):
    """A trivial layer (one weight, one multiply): what the engine costs besides the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _calibrate(
    schedule: str,
    optimizer: OptimizerFactory,
    config: PipeMareConfig | None,
    repeats: int,
    device: torch.device,
) -> list[tuple[str, _Samples]]:
    """The engine's fixed seconds per action: a pipeline of trivial layers, whose middle
    stages (delayed) and last stage (no delay; it hands the loss over) do next to nothing;
    and the middle stages again with :class:`_LayerClock`'s hooks on."""
    model = nn.Sequential(*[_Scalar() for _ in range(5)]).to(device)
    x = torch.ones(1, 1, device=device)
    batch = (x, torch.zeros(1, device=device))
    run = (batch, _sum_loss, optimizer, schedule, config, [1] * 5, max(repeats, 10), None)
    times, _ = _time_engine(model, *run)
    clocked = copy.deepcopy(model)
    clock = _LayerClock(clocked)  # what the layer hooks themselves cost, to take it out
    with_hooks, _ = _time_engine(clocked, *run, clock)
    clock.close()
    out = [("delayed", t) for t in times[1:4]] + [("undelayed", times[4])]
    return out + [("hooked", t) for t in with_hooks[1:4]]


# -- the cost model ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the model on the devices, with its modelled time and memory.

    Attributes:
        schedule: the schedule.
        stages: P, devices per pipeline.
        replicas: D, data-parallel copies of the pipeline (P × D devices).
        microbatches: N, microbatches per minibatch on each replica.
        microbatch_size: samples per microbatch.
        balance: layers per stage.
        step_s: modelled seconds per optimiser step (one minibatch of
            ``replicas × microbatches × microbatch_size`` samples), in steady state.
        stage_s: per stage, its busy seconds per step: N forward and backward passes, the
            update and the gradient all-reduce across replicas.
        memory_bytes: per stage, modelled peak bytes on its device.
    """

    schedule: str
    stages: int
    replicas: int
    microbatches: int
    microbatch_size: int
    balance: tuple[int, ...]
    step_s: float
    stage_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return self.replicas * self.microbatches * self.microbatch_size

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_s if self.step_s > 0 else math.inf


class _Costs:
    """Prefix sums over the layers, so a stage's cost and memory take O(1) to model."""

    def __init__(
        self,
        layers: Sequence[LayerProfile],
        input_bytes: int,
        profile: Profile,
        microbatches: int,
        replicas: int,
        bandwidth: float | None,
    ) -> None:
        self.n, self.microbatches = len(layers), microbatches
        # ring all-reduce: each device sends and receives 2(D-1)/D of the gradient bytes
        ring = 2 * (replicas - 1) / replicas
        self.allreduce = ring / bandwidth if bandwidth and replicas > 1 else 0.0
        self.bandwidth = bandwidth
        self.out = [layer.output_bytes for layer in layers]
        self.inputs = [input_bytes, *self.out[:-1]]
        self.keeps_input = [layer.saves_input for layer in layers]
        self.keeps_output = [layer.saves_output for layer in layers]

        def prefix(values: Iterable[float]) -> list[float]:
            sums = [0.0]
            for v in values:
                sums.append(sums[-1] + v)
            return sums

        # per action, [fixed seconds, prefix sums of what each layer adds] on a delayed stage
        # and on the undelayed last one: a stage of k layers pays the fixed part once
        self._delayed = self._marginal(layers, profile.overhead, True)
        self._last = self._marginal(layers, profile.undelayed_overhead or profile.overhead, False)
        self.params = prefix(x.param_bytes for x in layers)
        self.grads = prefix(x.grad_bytes for x in layers)
        self.state = prefix(x.state_bytes for x in layers)
        self.saved = prefix(x.saved_bytes for x in layers)
        # an activation between two layers of one stage lives on if either side saves it
        self.inner = prefix(
            out * (self.keeps_output[i] or self.keeps_input[i + 1])
            for i, out in enumerate(self.out[:-1])
        )

    @staticmethod
    def _marginal(
        layers: Sequence[LayerProfile], overhead: Overhead, delayed: bool
    ) -> list[tuple[float, list[float]]]:
        fixed = (overhead.forward_s, overhead.backward_s, overhead.update_s)
        out = []
        for kind in range(3):
            sums = [0.0]
            for x in layers:
                sums.append(sums[-1] + x.times(delayed)[kind])
            out.append((fixed[kind], sums))
        return out

    def times(self, a: int, b: int) -> tuple[float, float, float]:
        """Forward, backward and update seconds (all-reduce included) of layers ``a..b-1``;
        the last stage's without the delay's work."""
        parts = self._last if b == self.n else self._delayed
        f, bw, u = (fixed + sums[b] - sums[a] for fixed, sums in parts)
        return f, bw, u + self.allreduce * (self.grads[b] - self.grads[a])

    def busy(self, a: int, b: int) -> float:
        f, bw, u = self.times(a, b)
        return self.microbatches * (f + bw) + u

    def link(self, b: int) -> float:
        """Seconds per step the link after layer ``b-1`` carries activations (gradients back)."""
        if b >= self.n or not self.bandwidth:
            return 0.0
        return self.microbatches * self.out[b - 1] / self.bandwidth

    def activation(self, a: int, b: int) -> float:
        """Bytes a stage of layers ``a..b-1`` keeps per microbatch in flight."""
        kept = self.inputs[a] if a > 0 or self.keeps_input[a] else 0
        last = self.out[b - 1] if b < self.n or self.keeps_output[b - 1] else 0
        return kept + self.saved[b] - self.saved[a] + self.inner[b - 1] - self.inner[a] + last

    def memory(self, a: int, b: int, in_flight: int, stashed: int) -> float:
        weights = self.params[b] - self.params[a]
        fixed = (
            weights * (1 + stashed) + self.grads[b] - self.grads[a] + self.state[b] - self.state[a]
        )
        return fixed + in_flight * self.activation(a, b)


def _family(schedule: str) -> tuple[bool, bool, bool]:
    sp = spec(schedule)
    return sp.flushes, sp.stashes, sp.corrected


def _check_schedule(profile: Profile, schedule: str | None) -> str:
    if schedule is None:
        return profile.schedule
    if _family(schedule) != _family(profile.schedule):
        raise ValueError(
            f"the profile was measured under schedule {profile.schedule!r}, whose engine costs "
            f"differ from {schedule!r}'s (corrections, weight stashing); profile again with "
            f"schedule={schedule!r}"
        )
    return schedule


@dataclasses.dataclass(frozen=True)
class _Streams:
    """A schedule's action lists for a replay, in an order that respects the dependencies."""

    order: tuple[tuple[int, Op, int], ...]
    first: int  # the steady-state window's first and last minibatch
    last: int
    peaks: tuple[tuple[int, int], ...]  # per stage: most microbatches in flight, stashed versions


_STREAMS: dict[tuple[str, int, int], _Streams] = {}


def _streams(schedule: str, stages: int, microbatches: int) -> _Streams:
    key = (schedule, stages, microbatches)
    if key not in _STREAMS:
        fill = -(-stages // microbatches)  # minibatches in flight on stage 0 at most
        first, window = fill + 2, 6
        plans = generate(schedule, stages, microbatches, first + window + fill + 1)
        _STREAMS[key] = _Streams(
            _causal(plans),
            first,
            first + window,
            tuple(_peaks(actions, microbatches, spec(schedule).stashes) for actions in plans),
        )
    return _STREAMS[key]


def _causal(plans: list[list[Any]]) -> tuple[tuple[int, Op, int], ...]:
    """Interleave the stages' actions as the executor would: each waits for its inputs."""
    last, pos = len(plans) - 1, [0] * len(plans)
    done: set[tuple[int, Op, int]] = set()
    order: list[tuple[int, Op, int]] = []
    progressed = True
    while progressed:
        progressed = False
        for i, actions in enumerate(plans):
            while pos[i] < len(actions):
                a = actions[pos[i]]
                if a.op is Op.FORWARD and i > 0 and (i - 1, Op.FORWARD, a.index) not in done:
                    break
                if a.op is Op.BACKWARD and i < last and (i + 1, Op.BACKWARD, a.index) not in done:
                    break
                done.add((i, a.op, a.index))
                order.append((i, a.op, a.index))
                pos[i] += 1
                progressed = True
    return tuple(order)


def _peaks(actions: Sequence[Any], microbatches: int, stashes: bool) -> tuple[int, int]:
    """Most microbatches in flight on a stage, and most weight versions it stashes.

    Follows :class:`pipemare.engine.stage.Stage`: a microbatch is in flight from its forward to its
    backward; with weight stashing an update copies the live version when an in-flight
    microbatch still needs it, and a copy goes when its last microbatch's backward ran.
    """
    version, pending, users = 0, {}, Counter[int]()
    stash: set[int] = set()
    peak_flight = peak_stash = 0
    for a in actions:
        if a.op is Op.FORWARD:
            pending[a.index] = version
            users[version] += 1
            peak_flight = max(peak_flight, len(pending))
        elif a.op is Op.BACKWARD:
            v = pending.pop(a.index)
            users[v] -= 1
            if users[v] == 0:
                del users[v]
                stash.discard(v)
        else:
            if stashes and users[version] > 0:
                stash.add(version)
                peak_stash = max(peak_stash, len(stash))
            version += 1
    return peak_flight, peak_stash


def _replay(
    streams: _Streams,
    durations: Sequence[tuple[float, float, float]],
    links: Sequence[float] | None,
) -> dict[int, dict[int, float]]:
    """Replay the streams with each stage's durations; per stage, when each update ended.

    Without ``links`` communication is free and the replay is
    :func:`pipemare.engine.telemetry.replay_timeline` itself, on synthetic spans. With ``links``
    (seconds to carry one microbatch's activation over the link after stage ``i``; its
    gradient takes as long back) a message leaves when its action ends, queues behind the
    link's earlier messages and arrives that many seconds later; compute and transfers overlap.
    """
    names = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.UPDATE: "U"}
    if links is None:
        spans: list[Span] = []
        for stage, op, index in streams.order:
            seconds = durations[stage]["FBU".index(names[op])]
            spans.append((stage, names[op], index, 0.0, seconds))
        replayed, _ = replay_timeline(spans, len(durations))
        return _update_ends(replayed)
    return _replay_links(streams, durations, links)


def _replay_links(
    streams: _Streams,
    durations: Sequence[tuple[float, float, float]],
    links: Sequence[float],
) -> dict[int, dict[int, float]]:
    last = len(durations) - 1
    free = [0.0] * len(durations)
    arrive: dict[tuple[Op, int, int], float] = {}  # (op, microbatch, receiving stage)
    busy = {Op.FORWARD: [0.0] * len(durations), Op.BACKWARD: [0.0] * len(durations)}
    ends: dict[int, dict[int, float]] = defaultdict(dict)
    for stage, op, index in streams.order:
        start = free[stage]
        if (op is Op.FORWARD and stage > 0) or (op is Op.BACKWARD and stage < last):
            start = max(start, arrive.pop((op, index, stage)))
        end = start + durations[stage][(Op.FORWARD, Op.BACKWARD, Op.UPDATE).index(op)]
        free[stage] = end
        if op is Op.UPDATE:
            ends[stage][index] = end
        elif (op is Op.FORWARD and stage < last) or (op is Op.BACKWARD and stage > 0):
            to = stage + 1 if op is Op.FORWARD else stage - 1
            channel = busy[op]
            edge = min(stage, to)  # the link between stages edge and edge+1
            channel[edge] = max(end, channel[edge]) + links[edge]
            arrive[(op, index, to)] = channel[edge]
    return ends


def _update_ends(spans: Iterable[Span]) -> dict[int, dict[int, float]]:
    ends: dict[int, dict[int, float]] = defaultdict(dict)
    for stage, name, index, _, end in spans:
        if name == "U":
            ends[stage][index] = end
    return ends


def _period(ends: dict[int, dict[int, float]], first: int, last: int) -> float:
    """Seconds per minibatch between updates ``first`` and ``last``: the slowest stage's."""
    return max((e[last] - e[first]) / (last - first) for e in ends.values())


def steady_step_time(spans: Sequence[Span], num_stages: int, skip: int = 2) -> float:
    """Seconds per optimiser step of a measured run, as P devices would take it.

    Replays the spans with :func:`pipemare.engine.telemetry.replay_timeline` and measures, on every
    stage, the time between its update of the first recorded minibatch (plus ``skip``, to let
    the replay settle) and its last recorded update; the slowest stage's rate is the step time.
    :func:`evaluate` models the same quantity, so the two compare like with like.

    Raises:
        ValueError: fewer than ``skip + 2`` updates were recorded on some stage.
    """
    replayed, _ = replay_timeline(spans, num_stages)
    ends = _update_ends(replayed)
    common = set.intersection(*(set(e) for e in ends.values())) if ends else set()
    if len(ends) < num_stages or len(common) < skip + 2:
        raise ValueError(
            f"the spans hold {len(common)} updates on every stage; record at least {skip + 2} "
            "steps (attach Probe(timeline=True) for longer)"
        )
    ordered = sorted(common)
    return _period(ends, ordered[skip], ordered[-1])


def evaluate(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    microbatch_size: int,
    replicas: int = 1,
    schedule: str | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> Layout:
    """Model one layout: its steady-state step time and each stage's memory.

    A stage's forward (backward, update) seconds are the engine's fixed per-action seconds
    plus what each of its layers adds on top of them. The schedule's action streams run
    through :func:`pipemare.engine.telemetry.replay_timeline` with those durations; the step time is
    the slowest stage's time between updates once the pipeline is full. With replicas, each
    update first all-reduces the stage's gradients over a ring, ``2(D-1)/D × bytes /
    bandwidth`` seconds. With a bandwidth, activations and gradients cross each link in
    ``bytes / bandwidth`` seconds, one at a time, overlapping compute.

    Memory per stage: parameters, gradients, optimiser state and correction buffers, stashed
    weight versions (``pipedream``), and the activations autograd saves for one microbatch
    (the stage's input, what its layers save, its output) times the most microbatches the
    schedule keeps in flight on that stage. Workspace and allocator slack are not counted.

    Args:
        profile: from :func:`profile`.
        balance: layers per stage.
        microbatches: N.
        microbatch_size: samples per microbatch (the profile's sizes, or interpolated).
        replicas: D.
        schedule: default: the profile's.
        bandwidth_bytes_per_s: of the links between devices; None: communication is free
            (as in the simulator's own replay).

    Returns:
        The :class:`Layout`.
    """
    schedule = _check_schedule(profile, schedule)
    partition.check_balance(balance, profile.num_layers)
    _check_whole("microbatches", microbatches)
    _check_whole("replicas", replicas)
    layers, input_bytes = profile.at(microbatch_size)
    costs = _Costs(layers, input_bytes, profile, microbatches, replicas, bandwidth_bytes_per_s)
    return _layout(costs, schedule, list(balance), replicas, microbatch_size)


def _check_whole(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    ends = [sum(balance[: i + 1]) for i in range(len(balance))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _layout(
    costs: _Costs, schedule: str, balance: list[int], replicas: int, microbatch_size: int
) -> Layout:
    stages, n = len(balance), costs.microbatches
    streams = _streams(schedule, stages, n)
    bounds = _bounds(balance)
    durations = [costs.times(a, b) for a, b in bounds]
    links = None
    if costs.bandwidth:
        links = [costs.out[b - 1] / costs.bandwidth for _, b in bounds[:-1]] or [0.0]
    step = _period(_replay(streams, durations, links), streams.first, streams.last)
    memory = tuple(round(costs.memory(a, b, *streams.peaks[j])) for j, (a, b) in enumerate(bounds))
    busy = tuple(costs.busy(a, b) for a, b in bounds)
    return Layout(
        schedule, stages, replicas, n, microbatch_size, tuple(balance), step, busy, memory
    )


# -- the partition: dynamic programming over contiguous ranges -----------------------------


def _cut(
    num_layers: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    joined: Iterable[int] = (),
    even_first: bool = False,
) -> list[int] | None:
    """Contiguous cut of ``num_layers`` layers into ``stages`` minimising the largest
    ``cost(stage, begin, end)``; infinite costs are forbidden. Ties go to the most even cut
    (in layers per stage); ``even_first``: the most even allowed cut, ties to the cheapest.

    PipeDream's optimizer recursion: the best cut of the first ``end`` layers into ``j``
    stages extends the best cut of the first ``begin`` layers into ``j - 1``.
    """
    inf = (math.inf, math.inf)
    joined = set(joined)
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    ideal = num_layers / stages

    def order(key: tuple[float, float]) -> tuple[float, float]:
        return key[::-1] if even_first else key

    for j in range(1, stages + 1):
        for end in range(j, num_layers - (stages - j) + 1):
            for begin in range(j - 1, end):
                prev = best[j - 1][begin]
                if prev[0] == math.inf or (begin > 0 and begin in joined):
                    continue
                c = cost(j - 1, begin, end)
                if c == math.inf:
                    continue
                cand = (max(prev[0], c), prev[1] + abs((end - begin) - ideal))
                if order(cand) < order(best[j][end]):
                    best[j][end], cut[j][end] = cand, begin
    if best[stages][num_layers][0] == math.inf:
        return None
    balance, end = [], num_layers
    for j in range(stages, 0, -1):
        begin = cut[j][end]
        balance.append(end - begin)
        end = begin
    return balance[::-1]


def _best_layout(
    costs: _Costs,
    schedule: str,
    stages: int,
    limit: float | None,
    joined: Iterable[int],
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

    fastest = _cut(costs.n, stages, busy, joined)
    if fastest is None:
        return None
    cuts = [fastest]
    if tolerance > 0:
        bound = (1 + tolerance) * max(busy(j, a, b) for j, (a, b) in enumerate(_bounds(fastest)))
        near = _cut(costs.n, stages, lambda j, a, b: _within(busy(j, a, b), bound), joined, True)
        cuts.append(near or fastest)
    if spec(schedule).flushes:
        cuts.append(_cut(costs.n, stages, pace, joined) or fastest)
    layouts = {tuple(c): _layout(costs, schedule, c, replicas, microbatch_size) for c in cuts}
    quickest = min(lay.step_s for lay in layouts.values())
    ties = [lay for lay in layouts.values() if lay.step_s <= quickest * (1 + tolerance)]
    ideal = costs.n / stages
    return min(ties, key=lambda lay: sum(abs(b - ideal) for b in lay.balance))


def _within(cost: float, bound: float) -> float:
    return cost if cost <= bound else math.inf


def _least_memory(
    costs: _Costs, schedule: str, stages: int, joined: Iterable[int]
) -> tuple[float, list[int]]:
    """The smallest fullest-stage memory any cut reaches, and that cut."""
    peaks = _streams(schedule, stages, costs.microbatches).peaks
    balance = _cut(costs.n, stages, lambda j, a, b: costs.memory(a, b, *peaks[j]), joined)
    assert balance is not None  # without a limit some cut always exists
    bounds = _bounds(balance)
    return max(costs.memory(a, b, *peaks[j]) for j, (a, b) in enumerate(bounds)), balance


# -- the plan ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice and the layouts it beat.

    Attributes:
        best: the fastest layout that fits.
        runner_ups: the next fastest layouts (one per P, D, N), fastest first.
        devices: the devices planned for.
        memory_limit_bytes: per device, or None.
        bandwidth_bytes_per_s: of the links, or None (free).
        considered: how many layouts fitted and were modelled.
        skipped: why the other candidates were left out.
    """

    best: Layout
    runner_ups: tuple[Layout, ...]
    devices: int
    memory_limit_bytes: int | None
    bandwidth_bytes_per_s: float | None
    considered: int
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        """The choice, its modelled step time and memory per stage, and the runner-ups."""
        b = self.best
        limit = _size(self.memory_limit_bytes) if self.memory_limit_bytes else "none"
        link = (
            f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s" if self.bandwidth_bytes_per_s else "free"
        )
        lines = [
            f"pipemare plan: {self.devices} device{'s' if self.devices > 1 else ''}, batch "
            f"{b.batch_size}, schedule {b.schedule}, memory limit {limit} per device, link {link}",
            f"choice: P={b.stages} stages x D={b.replicas} replicas, N={b.microbatches} "
            f"microbatches of {b.microbatch_size}, balance {list(b.balance)}",
            f"modelled step time: {_ms(b.step_s)} ({b.samples_per_s:,.0f} samples/s)",
            "",
            f"{'stage':>5}  {'layers':>9}  {'busy/step':>10}  {'memory':>10}",
        ]
        for j, (lo, hi) in enumerate(_bounds(b.balance)):
            layers = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
            lines.append(
                f"{j:>5}  {layers:>9}  {_ms(b.stage_s[j]):>10}  {_size(b.memory_bytes[j]):>10}"
            )
        lines += ["", f"runner-ups ({self.considered} layouts fitted):"]
        if not self.runner_ups:
            lines.append("  none")
        else:
            lines.append(
                f"{'P':>4} {'D':>3} {'N':>4} {'micro':>6} {'step':>10} {'vs best':>8} "
                f"{'peak memory':>12}  balance"
            )
        for r in self.runner_ups:
            lines.append(
                f"{r.stages:>4} {r.replicas:>3} {r.microbatches:>4} {r.microbatch_size:>6} "
                f"{_ms(r.step_s):>10} {r.step_s / b.step_s:>7.2f}x "
                f"{_size(max(r.memory_bytes)):>12}  {list(r.balance)}"
            )
        if self.skipped:
            lines += ["", f"left out ({len(self.skipped)}):", *(f"  {s}" for s in self.skipped)]
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
    most = profile.num_layers - len(profile.joined)
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
            best = _best_layout(
                costs, schedule, p, memory_limit_bytes, profile.joined, tolerance, d, m
            )
            if best is None:
                need, _ = _least_memory(costs, schedule, p, profile.joined)
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
    memory is within ``memory_limit_bytes``. Layers sharing a parameter stay in one stage.

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
        >>> auto_balance(seq, torch.randn(4, 16), stages=2, microbatches=2, repeats=2)
        [2, 2]
    """
    partition.check_sequential(seq)
    partition.even_balance(len(seq), stages)  # refuses impossible stage counts
    partition.check_ties(seq, stages)
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
    layers, input_bytes = prof.at(prof.sizes[0])
    costs = _Costs(layers, input_bytes, prof, microbatches, 1, bandwidth_bytes_per_s)
    best = _best_layout(
        costs, schedule, stages, memory_limit_bytes, prof.joined, tolerance, 1, prof.sizes[0]
    )
    if best is None:
        assert memory_limit_bytes is not None
        need, _ = _least_memory(costs, schedule, stages, prof.joined)
        raise ValueError(
            f"no cut of {len(seq)} layers into {stages} stages fits {_size(memory_limit_bytes)} "
            f"per device: the leanest needs {_size(need)} on its fullest stage; raise the "
            "limit, use more stages or more, smaller microbatches"
        )
    return list(best.balance)


# -- pipemare plan --config ... ------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512 MB"``, ``"1e9"`` -> bytes.

    Example:
        >>> parse_bytes("1.5 GiB"), parse_bytes("512MB"), parse_bytes("1e9")
        (1610612736, 512000000, 1000000000)
    """
    found = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not found or found.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write e.g. 8GiB, 512MB or 1e9 (bytes)"
        )
    try:
        value = float(found.group(1)) * _UNITS[found.group(2)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory limit must be positive, got {text!r}")
    return int(value)


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers >= 1 separated by commas, e.g. 1,2,4,8, got {text!r}"
        )
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipemare plan",
        description="Profile the config's model on this device and choose stages x replicas, "
        "microbatches and the partition with the smallest modelled step time.",
    )
    parser.add_argument("--config", required=True, help="a LightningCLI config (configs/*.yaml)")
    parser.add_argument(
        "--devices", type=_positive(int), help="devices to plan for (default: the config's stages)"
    )
    parser.add_argument(
        "--memory-limit", type=parse_bytes, help="per device, e.g. 8GiB (default: none)"
    )
    parser.add_argument(
        "--bandwidth",
        type=_positive(float),
        default=3e9,
        help="link bandwidth in bytes/s (default 3e9, gloo over loopback)",
    )
    parser.add_argument("--schedule", help="default: the config's")
    parser.add_argument(
        "--microbatches",
        type=_counts,
        default=list(DEFAULT_MICROBATCHES),
        help="microbatch counts to try, e.g. 1,2,4,8",
    )
    parser.add_argument(
        "--batch-size", type=_positive(int), help="default: the config's training batch"
    )
    parser.add_argument(
        "--repeats", type=_positive(int), default=5, help="timed steps per size and round"
    )
    parser.add_argument(
        "--rounds", type=_positive(int), default=3, help="profile rounds, taken in turn"
    )
    parser.add_argument("--top", type=int, default=5, help="runner-ups to show")
    return parser


def _fail(message: str) -> SystemExit:
    print(f"pipemare plan: error: {message}", file=sys.stderr)
    return SystemExit(2)


def main(argv: list[str] | None = None) -> Plan:
    """``pipemare plan --config CONFIG.yaml [--devices K] [--memory-limit 8GiB] ...``.

    Builds the config's model and datamodule, takes one training batch, finds the pipelined
    ``nn.Sequential`` and its input as the strategy does, profiles it at every microbatch size
    the candidate layouts need and prints :meth:`Plan.describe`. Exits with status 2 and a
    message on bad arguments.
    """
    args = _parser().parse_args(argv)
    if args.schedule is not None:
        try:
            spec(args.schedule)
        except ValueError as err:
            raise _fail(str(err)) from None
    import os

    if not os.path.isfile(args.config):
        raise _fail(f"no config file at {args.config!r}; pass e.g. --config configs/mnist.yaml")
    setup = _from_config(args.config)
    schedule = args.schedule or setup["schedule"]
    devices = args.devices or setup["devices"]
    x, batch = setup["input"], setup["batch"]
    batch_size_ = args.batch_size or globals()["batch_size"](x)
    sizes = _sizes_needed(devices, batch_size_, args.microbatches, len(setup["seq"]))
    rows = globals()["batch_size"](x)
    if not sizes or max(sizes) > rows:
        raise _fail(
            f"no microbatch size to profile: batch {batch_size_} over {devices} devices and "
            f"microbatches {args.microbatches} (the config's batch holds {rows} samples)"
        )
    start = time.perf_counter()
    try:
        prof = profile(
            setup["seq"],
            x,
            target=batch,
            loss_fn=setup["loss"],
            optimizer=setup["optimizer"],
            schedule=schedule,
            config=setup["config"] if schedule == setup["schedule"] else None,
            microbatch_sizes=sizes,
            repeats=args.repeats,
            rounds=args.rounds,
        )
        result = plan(
            prof,
            devices=devices,
            batch_size=batch_size_,
            memory_limit_bytes=args.memory_limit,
            bandwidth_bytes_per_s=args.bandwidth,
            microbatches=args.microbatches,
            top=args.top,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    print(
        f"profiled {len(setup['seq'])} layers at microbatch sizes {sizes} in "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(result.describe())
    return result


def _sizes_needed(devices: int, batch: int, microbatches: Sequence[int], layers: int) -> list[int]:
    sizes: set[int] = set()
    for p in range(1, min(devices, layers) + 1):
        d = devices // p
        if devices % p or batch % d:
            continue
        sizes.update(batch // d // n for n in microbatches if (batch // d) % n == 0)
    return sorted(sizes)


def _from_config(path: str) -> dict[str, Any]:
    """The config's Sequential, its input for one training batch, loss, optimiser, strategy."""
    import warnings

    from pipemare.experiments.cli import PipeMareCLI
    from pipemare.lightning.module_adapter import ModuleAdapter, find_sequential, loss_of

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both are given
    try:
        cli = PipeMareCLI(args=["--config", path], run=False)
    finally:
        sys.argv = argv
    model, data = cli.model, cli.datamodule
    strategy = cli.trainer.strategy
    stages = getattr(strategy, "stages", None)
    settings = {
        "schedule": getattr(strategy, "schedule", "pipemare"),
        "config": getattr(strategy, "config", None),
        "devices": stages or max(cli.trainer.num_devices, 1),
    }
    if data is None:
        raise _fail("the config names no data (data: class_path: ...); the planner needs a batch")
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        name, seq = find_sequential(model, getattr(strategy, "sequential", None))
    except ValueError as err:
        raise _fail(str(err)) from None
    adapter = ModuleAdapter(model, name)
    x = adapter.capture_input("training_step", batch, 0)

    def loss(output: Any, microbatch: Any) -> torch.Tensor:
        with warnings.catch_warnings():  # self.log() outside a Trainer only warns
            warnings.simplefilter("ignore")
            return loss_of(adapter.run_with_output("training_step", output, microbatch, 0))

    return {
        **settings,
        "seq": seq,
        "input": x,
        "batch": batch,
        "loss": loss,
        "optimizer": _optimizer_factory(model),
    }


def _optimizer_factory(model: Any) -> OptimizerFactory:
    """The model's own optimiser class and settings, to build over any parameters."""
    configured = model.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        return torch.optim.Adam
    kind, defaults = type(configured), dict(configured.defaults)

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return kind(params, **defaults)

    return build
