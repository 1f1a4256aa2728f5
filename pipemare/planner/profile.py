"""Profiling a Sequential: every layer's forward, backward and update seconds, bytes sent and
saved, measured as the engine runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.engine.microbatch import batch_size
from pipemare.model import partition
from pipemare.model.partition import _flat, _layers
from pipemare.optim.config import PipeMareConfig
from pipemare.planner.measurements import (
    ForwardContext,
    LayerProfile,
    OptimizerFactory,
    Overhead,
    Profile,
)
from pipemare.planner.saved_bytes import _Bytes, _bytes_pass, _rows, _sum_loss
from pipemare.planner.timing import (
    TENSORS_PER_LAYER,
    _calibrate,
    _calibrate_dense,
    _empty,
    _extend,
    _median,
    _medians,
    _Runs,
    _Samples,
    _scalars_own_per_tensor,
    _time_loss,
    _time_stages,
    _time_updates,
    _Training,
    dense_width,
)
from pipemare.schedule.actions import spec


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
    training = _Training(
        loss_fn or _sum_loss, optimizer, schedule, config, repeats, forward_context
    )
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
            for name, samples in _calibrate(training, device):
                _extend(fixed[name], samples)
            for i, seconds in enumerate(_time_updates(seq, batches[0], training)):
                updates[i] += seconds
            for k, batch in enumerate(batches):
                _time_stages(seq, batch, training, runs[k])
        weights = [max(_median(u) - _median(fixed["delayed"][2]), 0.0) for u in updates]
        per_size, inputs = [], []
        for k, (x, t) in enumerate(batches):
            sizes_bytes, in_bytes = _bytes_pass(seq, x, t, loss_fn, forward_context)
            loss_times = _time_loss(seq, x, t, training)
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
        Overhead(*_medians(fixed["undelayed"])),
    )


def engine_overhead(
    schedule: str,
    optimizer: OptimizerFactory = torch.optim.SGD,
    *,
    config: PipeMareConfig | None = None,
    device: torch.device | str = "cpu",
    repeats: int = 10,
    per_param: bool = False,
    stage_params: int | None = None,
) -> Overhead:
    """The engine's own seconds per forward, backward and update action of a stage under
    ``schedule`` with ``optimizer``, whatever its layers: a pipeline of trivial layers (one
    scalar weight each) timed through its middle (delayed) stages. A stage's action costs
    this plus what its layers add; a replay of layer times alone misses it, which matters
    where a schedule runs many small actions (:func:`pipemare.planner.decide.decide` adds it).

    With ``per_param``, it times a pipeline of dense layers too, each about the size of a
    stage of ``stage_params`` trained parameters (:func:`~pipemare.planner.timing.dense_width`):
    what their update takes beyond the fixed cost, per parameter, is what a stage's update
    adds for each parameter it trains, and what a delayed stage's forward takes beyond the
    fixed cost and the layer's own pass, what it adds per parameter (weight prediction); and,
    for an asynchronous schedule, the update's rate on its last stage, which has no delay. A
    replay of the layers' own passes would otherwise miss both: a stage's update is the
    optimiser's and the corrections' arithmetic over its weights, milliseconds for a few
    million parameters on a CPU thread, and pipemare moves every weight of a delayed stage
    twice around each forward. It also times the trivial pipeline with many scalar weights a
    layer: what an update adds per tensor beyond the first (the optimiser's and the
    corrections' work per tensor, whatever its size), which a stage of many small tensors pays
    more of than of its parameters.

    Example:
        >>> fixed = engine_overhead("1f1b", per_param=True)
        >>> fixed.forward_s > 0 and fixed.update_s > 0 and fixed.update_per_param_s > 0
        True
        >>> predicted = engine_overhead("pipemare", torch.optim.AdamW, per_param=True)
        >>> predicted.forward_per_param_s > 0 and predicted.update_per_tensor_s > 0
        True
    """
    spec(schedule)
    training = _Training(_sum_loss, optimizer, schedule, config, repeats)
    device = torch.device(device)
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[]):
        delayed, undelayed = _pooled(_calibrate(training, device, hooked=False))
        fixed = _medians(delayed)
        if not per_param:
            return Overhead(*fixed)
        many, last_many = _pooled(
            _calibrate(training, device, hooked=False, weights=TENSORS_PER_LAYER)
        )
        own_forward, own_backward = _scalars_own_per_tensor(device)
        width = dense_width(stage_params)
        forward, update, last_update, params = _calibrate_dense(training, device, width)
    # each update beyond the one-weight stage's, per weight beyond its one
    per_tensor, last_per_tensor = (
        max(_median(more[2]) - _median(one[2]), 0.0) / (TENSORS_PER_LAYER - 1)
        for more, one in ((many, delayed), (last_many, undelayed))
    )
    # each delayed pass beyond the one-weight stage's, per weight, less the layer's own multiply
    forward_per_tensor, backward_per_tensor = (
        max((_median(many[k]) - _median(delayed[k])) / (TENSORS_PER_LAYER - 1) - own, 0.0)
        for k, own in ((0, own_forward), (1, own_backward))
    )
    flushing = spec(schedule).flushes  # every stage updates alike
    # the dense stand-in trains two tensors (weight, bias): one beyond the scalar layer's, in
    # its forward as in its update
    return Overhead(
        *fixed,
        update_per_param_s=max(update - fixed[2] - per_tensor, 0.0) / params,
        forward_per_param_s=max(forward - fixed[0] - forward_per_tensor, 0.0) / params,
        undelayed_update_per_param_s=None
        if flushing
        else max(last_update - fixed[2] - last_per_tensor, 0.0) / params,
        update_per_tensor_s=per_tensor,
        undelayed_update_per_tensor_s=None if flushing else last_per_tensor,
        forward_per_tensor_s=forward_per_tensor,
        backward_per_tensor_s=backward_per_tensor,
    )


def _pooled(runs: list[tuple[str, _Samples]]) -> tuple[_Samples, _Samples]:
    """:func:`_calibrate`'s samples pooled: its delayed stages', and its last stage's."""
    delayed, undelayed = _empty(), _empty()
    for name, samples in runs:
        _extend(delayed if name == "delayed" else undelayed, samples)
    return delayed, undelayed


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
