"""What one stage will hold, predicted before its first step, and the refusal of one that
cannot fit.

Per stage: its weights and a gradient for each trained one (counted as they are), the
optimiser's state (its bytes per trained byte, measured on a small copy of the optimiser
stepped once), the corrections' buffers (one copy of the trained weights for each correction
that keeps one), and the activations the microbatches the schedule keeps in flight on the stage
hold (one microbatch through the stage's own layers, its input's shape from a forward of the
layers before it on the meta device: no process holds another stage's weights to measure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from pipemare.lines import text
from pipemare.schedule.actions import Op, stream

__all__ = [
    "StageMemory",
    "check_fits",
    "most_in_flight",
    "saved_bytes_per_microbatch",
    "state_bytes_per_byte",
]

_MB = 2**20


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes one stage will hold at its peak, by part."""

    stage: int
    weights: int
    gradients: int
    optimizer_state: int
    corrections: int
    activations: int
    in_flight: int

    @property
    def total(self) -> int:
        return (
            self.weights + self.gradients + self.optimizer_state + self.corrections
            + self.activations
        )  # fmt: skip

    def describe(self) -> str:
        """One line: the total and its parts, in MB."""
        return (
            f"stage {self.stage}: {self.total / _MB:,.1f} MB = weights "
            f"{self.weights / _MB:,.1f} + gradients {self.gradients / _MB:,.1f} + optimiser "
            f"state {self.optimizer_state / _MB:,.1f} + correction buffers "
            f"{self.corrections / _MB:,.1f} + activations {self.activations / _MB:,.1f} "
            f"({self.in_flight} microbatch(es) in flight)"
        )


def most_in_flight(
    schedule: str, stages: int, microbatches: int, stage: int, warmup: int = 0
) -> int:
    """The most microbatches ``stage`` holds between their forward and their backward, read
    off the schedule's own action stream over its first minibatches.

    Example:
        >>> [most_in_flight("gpipe", 4, 8, i) for i in range(4)]
        [8, 8, 8, 8]
        >>> [most_in_flight("1f1b", 4, 8, i) for i in range(4)]
        [4, 3, 2, 1]
    """
    held = most = 0
    horizon = (warmup + stages + 3) * (2 * microbatches + 1)
    for action in itertools.islice(
        stream(schedule, stages, microbatches, stage, 0, warmup), horizon
    ):
        held += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(action.op, 0)
        most = max(most, held)
    return most


def state_bytes_per_byte(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> float:
    """Bytes of optimiser state per byte of trained weight: an optimiser of the same kind and
    settings over a small matrix, stepped once with a gradient (rate 0 leaves it as it is)."""
    probe = nn.Parameter(torch.zeros(64, 64))
    optimizer = make([probe])
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    probe.grad = torch.ones_like(probe)
    optimizer.step()
    held = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1  # step counters are scalars
    )
    return held / (probe.numel() * probe.element_size())


def saved_bytes_per_microbatch(
    before: Sequence[nn.Module],
    stage: Sequence[nn.Module],
    sample: Any,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    inputs_only: bool = False,
) -> int:
    """Bytes one microbatch keeps alive on the stage of layers ``first..`` until its backward:
    its input, what autograd saves in the stage's layers, and its output, each storage once.

    The layers before the stage run on the meta device, for the shapes of the stage's input
    (no storage: no process needs another stage's weights); the stage's own layers then run
    for real on one microbatch of that shape, its values random, so that what they save is
    what their kernels save.

    Args:
        before: the pipelined Sequential's layers before the stage's first.
        stage: the stage's own layers (its module's: a tied weight's copy included).
        sample: the pipelined module's input for one microbatch.
        forward_context: the precision plugin's context around each forward.
        inputs_only: the stage recomputes: it keeps only its input per microbatch.
    """
    with _without_hooks([*before, *stage]):
        return _held_by_one(
            before, stage, sample, forward_context or contextlib.nullcontext, inputs_only
        )


@contextlib.contextmanager
def _without_hooks(layers: Sequence[nn.Module]) -> Iterator[None]:
    """The user's forward hooks (logging, metrics) do not see the measurement's microbatch."""
    kept = []
    for layer in layers:
        for m in layer.modules():
            kept.append((m, m._forward_hooks, m._forward_pre_hooks))
            m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for m, hooks, pre_hooks in kept:
            m._forward_hooks, m._forward_pre_hooks = hooks, pre_hooks


def _held_by_one(
    before: Sequence[nn.Module],
    stage: Sequence[nn.Module],
    sample: Any,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    inputs_only: bool,
) -> int:
    x = sample
    device = next((t.device for m in stage for t in m.parameters()), torch.device("cpu"))
    if before:
        x = _shapes_after(before, sample, device, context)
    x = tree_map(lambda t: _like(t, device) if torch.is_tensor(t) else t, x)
    own = {t.untyped_storage().data_ptr() for m in stage for t in (*m.parameters(), *m.buffers())}
    held: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own and storage.data_ptr() != 0:
            held[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    for t in tree_flatten(x)[0]:
        if torch.is_tensor(t):
            count(t)
    if inputs_only:
        return sum(held.values())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in stage:
            with context():
                x = layer(x)
    for t in tree_flatten(x)[0]:
        if torch.is_tensor(t):
            count(t)
    return sum(held.values())


def _shapes_after(
    before: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Any:
    """What the layers ``before`` give for ``sample``, as shapes and dtypes without storage:
    fake tensors on ``device`` (a traced graph makes its positions and masks on the device it
    was traced for), else, where a layer's kernels cannot run on fake tensors (a mixture of
    experts' routing), meta tensors."""
    try:
        with FakeTensorMode(), torch.no_grad():
            return _through(before, sample, device, context)
    except Exception as fake_error:
        try:
            with torch.no_grad():
                return _through(before, sample, torch.device("meta"), context)
        except Exception:
            raise fake_error from None


def _through(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Any:
    """``sample`` through ``layers``, every tensor a blank of its shape on ``device``."""
    x = tree_map(lambda t: _blank(t, device) if torch.is_tensor(t) else t, sample)
    for layer in layers:
        with context():
            x = torch.func.functional_call(layer, _shapes_of(layer, device), (x,))
    return x


def _blank(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def _shapes_of(layer: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers as empty tensors of their shapes on ``device`` (fake,
    under the caller's FakeTensorMode), for a shapes-only forward."""
    named = [*layer.named_parameters(), *layer.named_buffers()]
    return {k: _blank(v, device) for k, v in named}


def _like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor of ``t``'s shape and dtype: random floats that ask for gradients (as an
    activation received from the stage before), zeros for indices and masks."""
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_()
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def check_fits(stages: Sequence[StageMemory], limit: int | None, where: str) -> None:
    """Refuse, before the first step, a stage predicted to need more than ``limit`` bytes.

    Raises:
        MemoryError: naming the stage, its parts and the fixes.
    """
    if limit is None:
        return
    over = [s for s in stages if s.total > limit]
    if not over:
        return
    worst = max(over, key=lambda s: s.total)
    raise MemoryError(
        text("memory.too_much", stage=worst.describe(), limit_mb=limit / _MB, where=where)
    )
