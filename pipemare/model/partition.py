"""Splitting an ``nn.Sequential`` into contiguous stages, and choosing the split (the balance)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "LayerTimes",
    "balance_by_cost",
    "balance_by_params",
    "balance_by_time",
    "check_balance",
    "check_sequential",
    "even_balance",
    "head_passes",
    "layer_out_bytes",
    "layer_passes",
    "layer_times",
    "split",
    "step_code_seconds",
    "time_layers",
]


def check_sequential(model: object, what: str = "the model") -> nn.Sequential:
    """Return ``model`` if it is a non-empty ``nn.Sequential``, else raise an error that says
    what to do."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"{what} must be a torch.nn.Sequential so it can be cut into stages, got "
            f"{type(model).__name__}; express the pipelined part as nn.Sequential(layer, ...)"
        )
    if len(model) == 0:
        raise ValueError(
            f"{what} is an empty nn.Sequential: there are no layers to cut into stages; put the "
            "layers in it (nn.Sequential(layer, ...)) before training"
        )
    return model


def _layers(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    # Not named_children(): it skips a layer object seen before, so a layer used twice
    # (nn.Sequential(lin, act, lin)) would silently vanish from the second place.
    return [(name, layer) for name, layer in model._modules.items() if layer is not None]


def check_balance(balance: Sequence[int], num_layers: int, what: str = "the model") -> None:
    """Refuse a list of layer counts that does not cut ``num_layers`` layers into stages."""
    counts = list(balance)
    if not counts or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in counts):
        raise ValueError(
            f"balance {counts} must list a whole number of layers (at least 1) for each stage, "
            f"e.g. {even_balance(num_layers, min(2, num_layers))}"
        )
    if sum(counts) != num_layers:
        hint = (
            f"e.g. {even_balance(num_layers, len(counts))}"
            if len(counts) <= num_layers
            else f"so at most {num_layers} stages"
        )
        raise ValueError(
            f"balance {counts} covers {sum(counts)} layers but {what} has {num_layers}; list how "
            f"many consecutive layers each stage takes, summing to {num_layers} ({hint})"
        )


def _check_stages(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {stages} stages: every stage needs at least "
            f"one layer; use stages <= {num_layers} or split the model into more layers"
        )


def even_balance(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, as equal as possible, earlier stages taking the remainder."""
    _check_stages(num_layers, stages)
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balance_by_cost(costs: Sequence[float], stages: int, tolerance: float = 0.0) -> list[int]:
    """Contiguous split of per-layer costs into ``stages`` parts minimising the largest part.

    Ties are broken towards the even split, so layers that cost nothing (activations) do not
    pile up on one stage; with ``tolerance``, a largest part up to ``1 + tolerance`` times the
    least counts as a tie (measured costs: the cut does not follow their noise).

    Example:
        >>> balance_by_cost([3.0, 3.0, 1.0, 1.0, 1.0, 1.0], 2)
        [2, 4]
        >>> balance_by_cost([3.0, 3.0, 1.0, 1.0, 1.0, 1.0], 2, tolerance=0.25)
        [3, 3]
    """
    n = len(costs)
    _check_stages(n, stages)
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
        prefix.append(prefix[-1] + float(c))

    balance = _min_max_cut(n, stages, lambda _, begin, end: prefix[end] - prefix[begin])
    assert balance is not None  # every cost is a number: some cut is allowed
    if tolerance <= 0:
        return balance
    bounds = [0, *itertools.accumulate(balance)]
    limit = (1 + tolerance) * max(prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds))

    def within(_: int, begin: int, end: int) -> float | None:
        cost = prefix[end] - prefix[begin]
        return cost if cost <= limit else None

    even = _min_max_cut(n, stages, within, even_first=True)
    assert even is not None  # the best cut itself is within
    return even


def _min_max_cut(
    num_layers: int,
    stages: int,
    cost: Callable[[int, int, int], float | None],
    even_first: bool = False,
) -> list[int] | None:
    """Contiguous cut of ``num_layers`` layers into ``stages`` minimising the largest
    ``cost(stage, begin, end)`` of a stage's layers ``begin .. end - 1``; a cost of None
    forbids that stage. Ties go to the most even cut (in layers per stage); ``even_first``:
    the most even allowed cut, ties to the cheapest. None when no cut is allowed.

    PipeDream's optimizer recursion: the best cut of the first ``end`` layers into ``j``
    stages extends the best cut of the first ``begin`` layers into ``j - 1``.
    """
    # best[j][end]: (largest stage cost, spread) for the first end layers cut into j stages.
    unreached = (math.inf, math.inf)
    best = [[unreached] * (num_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    ideal = num_layers / stages

    def order(key: tuple[float, float]) -> tuple[float, float]:
        return (key[1], key[0]) if even_first else key

    for j in range(1, stages + 1):
        for end in range(j, num_layers - (stages - j) + 1):
            for begin in range(j - 1, end):
                prev = best[j - 1][begin]
                if prev == unreached:
                    continue
                c = cost(j - 1, begin, end)
                if c is None:
                    continue
                cand = (max(prev[0], c), prev[1] + abs((end - begin) - ideal))
                if order(cand) < order(best[j][end]):
                    best[j][end], cut[j][end] = cand, begin
    if best[stages][num_layers] == unreached:
        return None
    balance, end = [], num_layers
    for j in range(stages, 0, -1):
        begin = cut[j][end]
        balance.append(end - begin)
        end = begin
    return balance[::-1]


def balance_by_params(model: nn.Sequential, stages: int) -> list[int]:
    """Split so that every stage holds about the same number of parameters."""
    check_sequential(model)
    costs = [sum(p.numel() for p in layer.parameters()) for _, layer in _layers(model)]
    return balance_by_cost(costs, stages)


def layer_times(model: nn.Sequential, sample: Any, repeats: int = 5) -> list[float]:
    """Seconds of each layer's forward plus backward pass on ``sample`` (the model's input):
    the median of ``repeats`` timings, taken as :func:`layer_passes` takes them.

    Each layer runs on the output of the previous one, as in the pipeline; gradients flow into
    a detached copy of the layer's input and are thrown away (parameters keep theirs), and the
    buffers (BatchNorm's running statistics) are put back as they were.
    """
    return [forward + backward for forward, backward in layer_passes(model, sample, repeats)]


def layer_passes(model: nn.Sequential, sample: Any, repeats: int = 5) -> list[tuple[float, float]]:
    """Seconds of each layer's forward pass and of its backward pass on ``sample``: the median
    of ``repeats`` rounds through every layer, after a first round that warms caches.

    A round times each layer once, in order, so a burst of load lands on one run of a few
    layers, not on every run of one; the median ignores it (two such runs of five). The median,
    not the fastest run: a run's step is its actions' typical time, which the replays built on
    these figures predict, as they take the engine's own costs per action
    (:mod:`pipemare.planner.timing`); the fastest of a few runs of a layer is some 10% below
    it on a CPU (four GPT blocks of width 192 timed alone: 16.6 ms fastest, 18.2 ms median).
    On the CPU with one thread (as each stage process of a CPU pipeline runs), a run's time
    is the thread's CPU time, which does not count the moments another process held the core:
    on a busy machine the wall clock of every run of a layer could hold such a pause, and
    move the layer's time, and with it the cut, from one run of the same script to the next.
    """
    return list(time_layers(model, sample, repeats=repeats).passes)


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """What :func:`time_layers` measured on one microbatch."""

    passes: tuple[tuple[float, float], ...]
    """Each layer's forward and backward seconds (:func:`layer_passes`)."""
    out_bytes: tuple[int, ...]
    """Each layer's output bytes (:func:`layer_out_bytes`)."""
    head: tuple[float, float] | None
    """The head's forward and backward seconds on the model's output (:func:`head_passes`);
    None without a head."""


def time_layers(
    model: nn.Sequential,
    sample: Any,
    head: Callable[[Any], Any] | None = None,
    repeats: int = 5,
) -> LayerTimes:
    """:func:`layer_passes`, :func:`layer_out_bytes` and, with ``head``, :func:`head_passes`
    from one forward through the layers without autograd, where calling the three would run
    three: each layer's input is kept from that forward, and the model's output is the head's.
    The buffers (BatchNorm's running statistics) are put back as they were.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> timed = time_layers(model, torch.randn(3, 4), head=lambda out: out.square().sum())
        >>> len(timed.passes), timed.out_bytes, timed.head is not None
        (3, (96, 96, 24), True)
    """
    check_sequential(model)
    # Timing runs the layers in their mode: a BatchNorm's running statistics would move.
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # Lightning may call this from validation, under inference mode: time with autograd on.
    try:
        with torch.inference_mode(False), torch.enable_grad():
            layers = [layer for _, layer in _layers(model)]
            inputs, x = [], _clone(sample)  # each layer's input, as the pipeline gives it
            with torch.no_grad():
                for layer in layers:
                    inputs.append(x)
                    x = layer(_leaf(x))
            sync, clock = _clock(sample)
            passes = _layer_passes(layers, inputs, repeats, sync, clock)
            timed_head = None
            if head is not None:
                timed_head = _head_passes(head, x, repeats, *_clock(x))
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return LayerTimes(
        passes=tuple(passes),
        out_bytes=tuple(_nbytes(out) for out in [*inputs[1:], x]),
        head=timed_head,
    )


def layer_out_bytes(model: nn.Sequential, sample: Any) -> list[int]:
    """Bytes of each layer's output on ``sample``: what a microbatch carries across a cut after
    that layer (one forward, without autograd)."""
    return [_nbytes(x) for x in _outputs(model, sample)]


def head_passes(
    head: Callable[[Any], Any],
    model: nn.Sequential,
    sample: Any,
    repeats: int = 5,
    clock: Callable[[], float] | None = None,
) -> tuple[float, float]:
    """Seconds of ``head``'s forward and of its backward into the model's output: what the last
    stage computes after its layers (a training step's loss, metrics and logs) on ``model``'s
    output for ``sample``, timed as :func:`layer_passes` times a layer, or on ``clock`` where
    the layers it goes with were timed on another (the planner's, for one).

    ``head`` takes the output and returns the loss. Its backward reaches the output only:
    parameters it uses outside the model are given no gradient.
    """
    with torch.inference_mode(False), torch.enable_grad():
        (output,) = collections.deque(_outputs(model, sample), maxlen=1)  # the last layer's
        sync, default = _clock(output)
        return _head_passes(head, output, repeats, sync, clock or default)


def _head_passes(
    head: Callable[[Any], Any],
    output: Any,
    repeats: int,
    sync: Callable[[], Any],
    clock: Callable[[], float],
) -> tuple[float, float]:
    forwards: list[float] = []
    backwards: list[float] = []
    for _ in range(repeats + 1):  # the first run warms caches up
        leaf = _leaf(output)
        into = [t for t in _flat(leaf) if t.requires_grad]
        forward_s, backward_s = _timed_pass(
            functools.partial(head, leaf), functools.partial(_grad_into, into), sync, clock
        )
        forwards.append(forward_s)
        backwards.append(backward_s)
    return statistics.median(forwards[1:]), statistics.median(backwards[1:])


def step_code_seconds(call: Callable[[], Any], sample: Any, repeats: int = 5) -> float:
    """Seconds of ``call()``: code of the step outside the layers that runs once per microbatch
    (the first stage's, before its model), on the device of ``sample``; the median of
    ``repeats`` runs after one that warms caches, on :func:`layer_passes`'s clock."""
    sync, clock = _clock(sample)
    runs = []
    for _ in range(repeats + 1):
        start = clock()
        call()
        sync()
        runs.append(clock() - start)
    return statistics.median(runs[1:])


def _outputs(model: nn.Sequential, sample: Any) -> Iterator[Any]:
    """Each layer's output on ``sample`` in turn, without autograd; the buffers are put back as
    they were once the last is given."""
    check_sequential(model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    x = _clone(sample)
    try:
        for _, layer in _layers(model):
            with torch.no_grad():
                x = layer(_leaf(x))
            yield x
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _clock(sample: Any) -> tuple[Callable[[], Any], Callable[[], float]]:
    """How a run is timed: what waits for the device, and the clock read around it."""
    if _on_cuda(sample):
        return torch.cuda.synchronize, time.perf_counter
    precise = time.get_clock_info("thread_time").resolution <= 1e-6
    if torch.get_num_threads() == 1 and precise:
        return (lambda: None), time.thread_time
    return (lambda: None), time.perf_counter


def _layer_passes(
    layers: list[nn.Module],
    inputs: list[Any],
    repeats: int,
    sync: Callable[[], Any],
    clock: Callable[[], float],
) -> list[tuple[float, float]]:
    """Each of ``layers`` timed on its input in ``inputs``, in rounds (:func:`layer_passes`)."""
    forwards: list[list[float]] = [[] for _ in layers]
    backwards: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats + 1):  # the first round warms caches up
        for layer, x, fw, bw in zip(layers, inputs, forwards, backwards, strict=True):
            forward_s, backward_s = _timed_pass(
                functools.partial(layer, _leaf(x)), _backward_ones, sync, clock
            )
            fw.append(forward_s)
            bw.append(backward_s)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    return [
        (statistics.median(fw[1:]), statistics.median(bw[1:]))
        for fw, bw in zip(forwards, backwards, strict=True)
    ]


def _timed_pass(
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    sync: Callable[[], Any],
    clock: Callable[[], float],
) -> tuple[float, float]:
    """Seconds of ``forward()`` and of ``backward`` on its result, each waited for."""
    start = clock()
    out = forward()
    sync()
    middle = clock()
    backward(out)
    sync()
    return middle - start, clock() - middle


def _grad_into(into: list[torch.Tensor], loss: Any) -> None:
    """A head's backward from its loss into ``into`` only (no parameter's gradient moves)."""
    if into and isinstance(loss, torch.Tensor) and loss.requires_grad:
        torch.autograd.grad(loss, into, allow_unused=True)


def _backward_ones(out: Any) -> None:
    """A layer's backward from its output: a gradient of ones into each tensor needing one."""
    outs = [t for t in _flat(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


#: ``balance="time"`` takes the most even cut whose slowest stage is within this share of the
#: best cut's: one batch's timings wobble by about as much, and a cut that followed the wobble
#: would differ from run to run (and so would the training: other layers are delayed).
TIME_TOLERANCE = 0.25


def balance_by_time(model: nn.Sequential, sample: Any, stages: int) -> list[int]:
    """Split so that every stage's measured forward+backward time is about the same: the most
    even cut (in layers) whose slowest stage is within :data:`TIME_TOLERANCE` of the best."""
    return balance_by_cost(layer_times(model, sample), stages, tolerance=TIME_TOLERANCE)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(value))


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    return value


def _on_cuda(value: Any) -> bool:
    return any(t.is_cuda for t in _flat(value))


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive ``nn.Sequential`` stages of ``balance[i]`` layers each.

    The stages share the layer objects with ``model``: no parameter is copied (a parameter
    that layers on several stages share is given copies by :func:`pipemare.engine.ties.untie`).
    """
    check_sequential(model)
    balance = list(balance)
    _check_stages(len(model), len(balance))
    check_balance(balance, len(model))
    layers = _layers(model)
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(OrderedDict(layers[start : start + size])))
        start += size
    return stages
