"""What a profile holds: each layer's measured costs at one microbatch size, the fixed per-action
overheads, and the profile that interpolates them.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


ForwardContext = Callable[[], contextlib.AbstractContextManager[Any]]


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
    ``update_per_param_s``: what the update adds per trained parameter of the stage (the
    optimiser's and the corrections' arithmetic), from the same pipeline with dense layers;
    ``forward_per_param_s``: what a delayed stage's forward adds per trained parameter beyond
    its layers (weight prediction moves every weight before the forward and back after it),
    from the same dense pipeline; 0 where not measured. ``undelayed_update_per_param_s``: the
    update's rate on a stage without delay (an asynchronous pipeline's last: the corrections
    that serve a delay keep nothing there); None where it is the same as the others'.
    ``update_per_tensor_s`` (``undelayed_update_per_tensor_s`` on a stage without delay, None:
    the same): what the update adds for each trained tensor beyond the first, whatever its
    size (the optimiser's and the corrections' dispatch per tensor: 25-35 µs with AdamW on a
    CPU thread, where a stage of a few dozen small tensors updates in a few milliseconds),
    from the same pipeline of trivial layers with many scalar weights a layer; 0 where not
    measured. ``forward_per_tensor_s`` and ``backward_per_tensor_s``: what the engine's
    forward and backward add for each trained tensor beyond the first, beyond the layers' own
    work on it (pipemare's forward keeps every weight's version and moves each weight twice
    for weight prediction: about 5 µs a tensor on a CPU thread, against under 1 µs for 1F1B),
    from the same pipeline, on its delayed stages and charged to every stage; 0 where not
    measured.
    """

    forward_s: float
    backward_s: float
    update_s: float
    update_per_param_s: float = 0.0
    forward_per_param_s: float = 0.0
    undelayed_update_per_param_s: float | None = None
    update_per_tensor_s: float = 0.0
    undelayed_update_per_tensor_s: float | None = None
    forward_per_tensor_s: float = 0.0
    backward_per_tensor_s: float = 0.0

    def charge(self, trained: int, delayed: bool, tensors: int = 1) -> tuple[float, float, float]:
        """What a stage that trains ``trained`` parameters in ``tensors`` tensors pays per
        forward, backward and update beyond its layers' own passes: the fixed seconds, the
        forward's rate where the stage is ``delayed`` (weight prediction), each pass's rate
        per tensor beyond the first, and the update's rates, per parameter and per tensor
        beyond the first, for a delayed stage or one without delay.

        Example:
            >>> last = Overhead(1.0, 2.0, 3.0, 0.5, 0.25, undelayed_update_per_param_s=0.1)
            >>> last.charge(4, delayed=True), last.charge(4, delayed=False)
            ((2.0, 2.0, 5.0), (1.0, 2.0, 3.4))
            >>> Overhead(1.0, 2.0, 3.0, update_per_tensor_s=0.5).charge(0, True, tensors=3)
            (1.0, 2.0, 4.0)
            >>> passes = Overhead(1.0, 2.0, 3.0, forward_per_tensor_s=0.5)
            >>> dataclasses.replace(passes, backward_per_tensor_s=0.25).charge(0, True, 3)
            (2.0, 2.5, 3.0)
        """

        def rate(shared: float, undelayed: float | None) -> float:
            return shared if delayed or undelayed is None else undelayed

        per_param = rate(self.update_per_param_s, self.undelayed_update_per_param_s)
        per_tensor = rate(self.update_per_tensor_s, self.undelayed_update_per_tensor_s)
        beyond = max(tensors - 1, 0)
        forward = self.forward_per_param_s * trained if delayed else 0.0
        forward += self.forward_per_tensor_s * beyond
        backward = self.backward_s + self.backward_per_tensor_s * beyond
        update = self.update_s + per_param * trained + per_tensor * beyond
        return self.forward_s + forward, backward, update


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs of a model, measured at one or more microbatch sizes.

    Attributes:
        schedule: the schedule the times were measured under (its corrections cost time).
        sizes: the microbatch sizes measured, ascending.
        layers: per size, one :class:`LayerProfile` per layer.
        input_bytes: per size, bytes of the model's input.
        overhead: the engine's fixed per-action seconds on a stage other than the last.
        undelayed_overhead: the fixed per-action seconds of the last stage (no delay; it also
            hands the loss over); None: the same as ``overhead``.
    """

    schedule: str
    sizes: tuple[int, ...]
    layers: tuple[tuple[LayerProfile, ...], ...]
    input_bytes: tuple[int, ...]
    overhead: Overhead
    undelayed_overhead: Overhead | None = None

    @property
    def num_layers(self) -> int:
        """The layers of the profiled Sequential."""
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
