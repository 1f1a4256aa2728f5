"""No-stash backward: parameters saved by reference, resolved to weights at backward time.

A forward pass saves activations as autograd normally does, but every parameter autograd
saves (or a view of one, such as the transposed weight ``linear`` keeps) is saved *by
reference*: ``(parameter, version, size, stride, offset)``. When the backward pass unpacks
it, the stage decides which weights it sees (:meth:`~pipemare.engine.stage.Stage.weight_at`):

- the live weights (``async``; and the flushing schedules, where they did not change),
- the live weights corrected by T2, ``w - Δ δ`` (``pipemare``),
- the weights of the forward's version (``pipedream``), copied only if an update is about
  to overwrite a version some microbatch still needs (copy-on-write stashing, :class:`Stash`).

So for ``y = W x`` a delayed backward gives ``dL/dx = W_bkwd^T dL/dy`` and
``dL/dW = dL/dy x_fwd^T``: activations from the forward pass, weights from the backward.
Weights computed *from* parameters inside a layer (e.g. ``w * scale``) are ordinary saved
tensors and keep their forward-time values.

Where the backward sees the live weights as they are (``async``, and ``pipemare`` without T2)
the stage needs no hook at all: autograd keeps the parameters it saves by reference anyway (the
tensors themselves, whose storage the update changes in place), and refuses only because each
in-place write bumps the tensor's version. The engine's own writes to a stage's weights between
a forward and its backward (the update, weight prediction's move and its undo, a tied weight's
installed copy) leave the versions as they found them (:func:`same_versions`), so autograd
unpacks the live weights itself. A Python hook per saved tensor costs 8-10% of a microbatch's
forward and backward on the protocol's GPT (``experiments/results/horizon/step_parts.py``); any
other in-place write still meets autograd's own error.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from pipemare.engine.memory import Held

__all__ = ["SavedTensors", "Stash", "same_versions", "set_versions", "versions"]


class _ParamRef(NamedTuple):
    param: nn.Parameter
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def versions(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's autograd version; None for an inference tensor (it has none, and no graph
    can save it)."""
    return [None if t.is_inference() else t._version for t in tensors]


def set_versions(tensors: Sequence[torch.Tensor], kept: Sequence[int | None]) -> None:
    """Set each tensor's autograd version counter (shared with its views) back to what
    :func:`versions` read."""
    pairs = [(t, v) for t, v in zip(tensors, kept, strict=True) if v is not None]
    if pairs:
        torch._C._autograd._unsafe_set_version_counter(
            tuple(t for t, _ in pairs), tuple(v for _, v in pairs)
        )


@contextlib.contextmanager
def same_versions(tensors: Sequence[torch.Tensor]) -> Iterator[Callable[[], None]]:
    """In-place writes to ``tensors`` inside leave their version counters as they found them,
    so a graph that saved them unpacks their values of the time of its backward. What it gives
    sets them back at once (before a forward that saves them inside).

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> y = (w * w).sum()  # saves w for its backward
        >>> with same_versions([w]), torch.no_grad():
        ...     _ = w.mul_(3)
        >>> y.backward()  # without same_versions: "modified by an inplace operation"
        >>> w._version
        0
    """
    kept = versions(tensors)
    try:
        yield lambda: set_versions(tensors, kept)
    finally:
        set_versions(tensors, kept)


class SavedTensors:
    """The saved-tensor hooks of one stage: its parameters by reference, the rest as they are.

    Args:
        params: the stage's parameters, by ``id``.
        buffers: the stage's buffers, by ``id`` (held anyway, so never counted as held).
        weight_at: ``(param, version)`` -> what a backward pass sees of ``param`` for a
            microbatch forwarded at ``version``.
        compiled: the stage's layers are compiled: the hooks run outside the compiler
            (``torch.compiler.disable``). Dynamo would otherwise trace the pack hook as a
            frame of its own and, its result depending on which tensor it packs, compile it
            again for each until its recompile limit.
    """

    def __init__(
        self,
        params: Mapping[int, nn.Parameter],
        buffers: Mapping[int, torch.Tensor],
        weight_at: Callable[[nn.Parameter, int], torch.Tensor],
        compiled: bool = False,
    ) -> None:
        self._params, self._buffers, self._weight_at = params, buffers, weight_at
        self._compiled = compiled
        self._unpack_hook = torch.compiler.disable(self._unpack) if compiled else self._unpack

    def hooks(
        self, version: int, track: bool, held: Held | None
    ) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks of one forward at weight ``version``: with ``track`` parameters are saved
        by reference; ``held``, if given, collects the other saved tensors' storages."""

        def pack(t: torch.Tensor) -> Any:
            base = t if t._base is None else t._base
            param = self._params.get(id(base))
            if param is None or param is not base:
                if held is not None and self._buffers.get(id(base)) is not base:
                    held.add(t)
                # Detached: an op that saves its own output (exp, softmax, tanh) would otherwise
                # hold that tensor from its own grad_fn, a cycle through C++ that Python's
                # collector cannot see; a graph never run backward (a torchmetrics step value)
                # then leaks whole. Autograd rebuilds the unpacked tensor's history itself.
                return t.detach()
            if not track:  # only measuring: nothing changes the weights before the backward
                return t
            offset = int(t.storage_offset() - base.storage_offset())
            return _ParamRef(base, version, t.size(), t.stride(), offset)

        if self._compiled:  # pack is a closure of this forward's: wrapped per forward
            pack = torch.compiler.disable(pack)
        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack_hook)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _ParamRef):
            return packed
        w = self._weight_at(packed.param, packed.version)
        return w.as_strided(packed.size, packed.stride, w.storage_offset() + packed.offset)


class Stash:
    """Copies of the weight versions in-flight microbatches still need (``pipedream``), made
    only when an update is about to overwrite one (copy on write).

    Args:
        params: the stage's parameters, by ``id``.

    Attributes:
        peak: the most versions held in copies at once so far.
        peak_bytes: the most bytes those copies held at once so far.
    """

    def __init__(self, params: Mapping[int, nn.Parameter]) -> None:
        self._params = params
        self._users: Counter[int] = Counter()  # in-flight microbatches per forward version
        self._copies: dict[int, dict[int, torch.Tensor]] = {}
        self.peak = self.peak_bytes = 0

    def hold(self, version: int) -> None:
        """A microbatch's forward ran at ``version``; its backward may need that version."""
        self._users[version] += 1

    def release(self, version: int) -> None:
        """A microbatch forwarded at ``version`` finished its backward."""
        self._users[version] -= 1
        if self._users[version] == 0:
            del self._users[version]
            self._copies.pop(version, None)

    @torch.no_grad()
    def before_update(self, version: int) -> None:
        """Copy the live weights, ``version``, if an in-flight microbatch still needs them."""
        if self._users[version] > 0:
            self._copies[version] = {i: p.detach().clone() for i, p in self._params.items()}
            self.peak = max(self.peak, len(self._copies))
            held = sum(t.nbytes for copy in self._copies.values() for t in copy.values())
            self.peak_bytes = max(self.peak_bytes, held)

    def weight(self, param: nn.Parameter, version: int) -> torch.Tensor:
        """The copy of ``param`` at ``version`` (an update has overwritten the live one)."""
        return self._copies[version][id(param)]

    def __len__(self) -> int:
        return len(self._copies)
