"""One pipeline stage: forward and backward of microbatches without stashing weights.

A forward pass saves activations as autograd normally does, but every parameter autograd
saves (or a view of one, such as the transposed weight ``linear`` keeps) is saved *by
reference*: ``(parameter, version, size, stride, offset)``. When the backward pass unpacks
it, the stage decides which weights it sees:

- the live weights (``async``; and the flushing schedules, where they did not change),
- the live weights corrected by T2, ``w - Δ δ`` (``pipemare``),
- the weights of the forward's version (``pipedream``), copied only if an update is about
  to overwrite a version some microbatch still needs (copy-on-write stashing).

So for ``y = W x`` a delayed backward gives ``dL/dx = W_bkwd^T dL/dy`` and
``dL/dW = dL/dy x_fwd^T``: activations from the forward pass, weights from the backward.
Weights computed *from* parameters inside a layer (e.g. ``w * scale``) are ordinary saved
tensors and keep their forward-time values.

Activation recomputation (``recompute=True``) is the other way to hold a microbatch: the
forward runs without a graph and keeps only the stage's inputs; the backward reruns the
forward first, at the weights the backward would see anyway (:meth:`Stage.weight_at`). So
*every* term of a delayed gradient, activations included, comes from backward-time weights:
for ``a = σ(W x)`` the rerun gives ``σ'(W_bkwd x)`` where the default keeps ``σ'(W_fwd x)``;
``x``, the stage's input, is the one the earlier stages sent at forward time either way.
Where the backward's weights are the forward's (``gpipe``, ``1f1b``, and ``pipedream``, whose
rerun runs on the stashed version) recomputation gives exactly the default's gradients. Under
``async`` and ``pipemare`` it gives a different gradient: the exact vector-Jacobian product of
the stage at its backward-time weights, taken at the forward-time input and the output
gradient the later stages send back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Stage", "as_payload", "tensors"]

Payload = tuple[torch.Tensor | None, ...]  # gradients: None where an input got none


class _ParamRef(NamedTuple):
    param: nn.Parameter
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _RngState(NamedTuple):
    """The random generators' states when a forward started, for its rerun (dropout masks)."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]  # (device index, state) per CUDA device used


@dataclasses.dataclass
class _Rerun:
    """What a recomputing stage keeps of a microbatch instead of its activations."""

    inputs: Any  # exactly what the module was called with
    rng: _RngState


@dataclasses.dataclass
class _InFlight:
    inputs: tuple[torch.Tensor, ...]  # leaves whose gradients backward returns
    outputs: Any  # None when the forward will be rerun
    version: int
    rerun: _Rerun | None = None
    held: dict[tuple[torch.device, int], int] | None = None  # storage -> bytes, if measured


class _Held:
    """Storages one microbatch keeps alive until its backward pass, by (device, address)."""

    __slots__ = ("storages",)

    def __init__(self) -> None:
        self.storages: dict[tuple[torch.device, int], int] = {}

    def add(self, t: torch.Tensor) -> None:
        if t.layout is not torch.strided:  # sparse and nested tensors: no single storage
            return
        storage = t.untyped_storage()
        self.storages[t.device, storage.data_ptr()] = storage.nbytes()


def as_payload(value: Any, stage: int, what: str = "output") -> Any:
    """Check that what a stage hands to the next one can travel: a Tensor or a tuple of Tensors."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return value
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds = sorted({type(v).__name__ for v in value})
        kind = f"{kind} of {', '.join(kinds)}"
    raise TypeError(
        f"stage {stage}'s {what} is a {kind}; between stages only a Tensor or a tuple of "
        "Tensors can travel. Return a tuple of tensors from the stage's last layer (pack other "
        "values into tensors) or move the stage boundary with `balance`"
    )


def tensors(value: Any) -> tuple[Any, ...]:
    """The entries of a payload as a tuple (a bare tensor becomes a 1-tuple)."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a stage's input or output: a tensor, or the entries of a tuple, list or
    dict (one level deep)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _leaves(value: Any) -> Any:
    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_(x.is_floating_point() or x.is_complex())

    return leaf(value) if isinstance(value, torch.Tensor) else tuple(leaf(x) for x in value)


class Stage:
    """Runs one stage's layers for forward and backward passes of microbatches.

    Args:
        index: this stage's position, 0..P-1.
        module: the stage's layers.
        stashes: keep the forward's weight version for the backward (PipeDream).
        track: save parameters by reference so updates may run between forward and backward.
            Flushing schedules never update in between and skip the hooks.
        backward_weight: ``(param, delta)`` -> the weights a backward pass ``delta`` updates
            after its forward should use (live weights, or T2's correction).
        forward_context: a context manager factory entered around every forward (autocast).
        forward_weights: ``(stage, horizon)`` -> a context manager entered around every
            training forward whose gradient will be applied ``horizon`` updates later; it may
            move the weights in place for the forward's duration (weight prediction).
        microbatches: N, to tell which update a microbatch's gradient feeds.
        seed: seed of this stage's own random stream (dropout draws the same numbers whether
            the stages share a process or not).
        recompute: keep only each microbatch's inputs and rerun the forward at backward time
            (activation recomputation; see the module docstring for the gradient it gives).
            The forward whose output goes downstream runs as usual, under ``forward_weights``
            (weight prediction) and without a graph; the rerun runs under ``forward_context``
            at :meth:`weight_at`'s weights, with the random numbers the forward drew (same
            dropout masks) and on copies of the module's buffers, so BatchNorm's running
            statistics update once. Forward hooks do run twice. A forward with a ``head``
            (the last stage's loss and metrics) never reruns, so logging and metric updates
            run once.
        measure_saved: count the bytes held for in-flight microbatches (:attr:`saved_bytes`,
            :attr:`peak_saved_bytes`). Default: on where it costs next to nothing (the stage
            tracks parameters, so its pack hook runs anyway, or it recomputes); a flushing
            stage that does not recompute needs a hook on every saved tensor to count.

    Attributes:
        saved_bytes: bytes this stage keeps right now for the backward passes of its
            in-flight microbatches: without recomputation the tensors autograd saved, the
            input leaves whose gradients it returns and the outputs it backpropagates from;
            with it the inputs only. Each storage counts once per microbatch; parameters and
            buffers (held anyway) count zero, and a storage several microbatches keep (the
            minibatch that stage 0's microbatches slice) counts once.
        peak_saved_bytes: the largest ``saved_bytes`` so far.

    Example:
        >>> stage = Stage(0, nn.Sequential(nn.Linear(4, 8), nn.Tanh()), recompute=True)
        >>> y = stage.forward(0, torch.ones(2, 4))
        >>> stage.saved_bytes  # the input only: 2 x 4 float32
        32
        >>> _ = stage.backward(0, (torch.ones(2, 8),))
        >>> stage.module[0].weight.grad.shape, stage.saved_bytes
        (torch.Size([8, 4]), 0)
    """

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        stashes: bool = False,
        track: bool = True,
        backward_weight: Callable[[nn.Parameter, int], torch.Tensor] | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        forward_weights: Callable[[int, int], contextlib.AbstractContextManager[Any]] | None = None,
        microbatches: int = 1,
        seed: int | None = None,
        recompute: bool = False,
        measure_saved: bool | None = None,
    ) -> None:
        self.index = index
        self.module = module
        self.version = 0
        self.stashes = stashes
        self.track = track
        self._backward_weight = backward_weight or (lambda p, _delta: p.detach())
        self._forward_context = forward_context or contextlib.nullcontext
        self._forward_weights = forward_weights
        self.microbatches = microbatches
        self._params = {id(p): p for p in module.parameters()}
        self._named_params = dict(module.named_parameters())
        self._buffers = {id(b): b for b in module.buffers()}
        self.recompute = recompute
        self.measure_saved = (track or recompute) if measure_saved is None else measure_saved
        self.saved_bytes = 0
        self.peak_saved_bytes = 0
        self._held: _Held | None = None  # the forward being measured
        self._live: Counter[tuple[torch.device, int]] = Counter()  # in-flight keepers per storage
        self._inflight: dict[int, _InFlight] = {}
        self._users: Counter[int] = Counter()  # in-flight microbatches per forward version
        self._stash: dict[int, dict[int, torch.Tensor]] = {}
        self.peak_stashed_versions = 0
        self.peak_in_flight = 0
        self._rng: torch.Tensor | None = None
        if seed is not None:
            self._rng = torch.Generator().manual_seed(seed).get_state()

    # -- saved-tensor hooks -------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        param = self._params.get(id(base))
        if param is None or param is not base:
            if self._held is not None and self._buffers.get(id(base)) is not base:
                self._held.add(t)
            return t
        if not self.track:  # only measuring: nothing changes the weights before the backward
            return t
        offset = int(t.storage_offset() - base.storage_offset())
        return _ParamRef(base, self.version, t.size(), t.stride(), offset)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _ParamRef):
            return packed
        w = self.weight_at(packed.param, packed.version)
        return w.as_strided(packed.size, packed.stride, w.storage_offset() + packed.offset)

    def weight_at(self, param: nn.Parameter, version: int) -> torch.Tensor:
        """What a backward pass sees of ``param`` for a microbatch forwarded at ``version``."""
        if self.stashes:
            if version == self.version:
                return param.detach()
            return self._stash[version][id(param)]
        return self._backward_weight(param, self.version - version)

    # -- forward / backward --------------------------------------------------------------

    @contextlib.contextmanager
    def _random_stream(self) -> Iterator[None]:
        if self._rng is None:
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self._rng)
        try:
            yield
        finally:
            self._rng = torch.get_rng_state()
            torch.set_rng_state(outer)

    def _rng_now(self, inputs: Any) -> _RngState:
        """The random state this stage's next forward starts from."""
        cpu = self._rng if self._rng is not None else torch.get_rng_state()
        cuda: tuple[tuple[int, torch.Tensor], ...] = ()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            used = [*self._params.values(), *_tensors_in(inputs)]
            devices = sorted({int(t.device.index or 0) for t in used if t.is_cuda})
            cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        return _RngState(cpu, cuda)

    @staticmethod
    @contextlib.contextmanager
    def _replayed(state: _RngState) -> Iterator[None]:
        """Run with the generators as a forward found them; restore them afterwards."""
        with torch.random.fork_rng(devices=[d for d, _ in state.cuda]):
            torch.set_rng_state(state.cpu)
            for device, cuda in state.cuda:
                torch.cuda.set_rng_state(cuda, device)
            yield

    def forward(
        self,
        microbatch: int,
        inputs: Any,
        head: Callable[[Any], Any] | None = None,
        grad: bool = True,
    ) -> Any:
        """Run the stage's layers (and ``head`` on their output, e.g. the loss) on ``inputs``.

        With ``grad`` the inputs become leaves whose gradients :meth:`backward` returns, and
        the microbatch stays in flight until then. A recomputing stage runs this forward
        without a graph (its output goes downstream as usual) and keeps only the inputs.
        """
        if grad and self.index > 0:
            inputs = _leaves(as_payload(inputs, self.index - 1))
        rerun = grad and self.recompute and head is None
        hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        weights: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if grad and self.track and self._forward_weights is not None:
            # the update this microbatch's gradient feeds, counted from the live version
            horizon = microbatch // self.microbatches - self.version
            weights = self._forward_weights(self.index, horizon)
        if grad and not rerun and (self.track or self.measure_saved):
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        held = _Held() if grad and self.measure_saved else None
        rng = self._rng_now(inputs) if rerun else None  # before the forward draws from it
        self._held = None if rerun else held
        try:
            with (
                torch.set_grad_enabled(grad and not rerun),
                self._random_stream(),
                weights,
                hooks,
                self._forward_context(),
            ):
                outputs = self.module(inputs)
                result = head(outputs) if head is not None else outputs
        finally:
            self._held = None
        if grad:
            leaves = tensors(inputs) if self.index > 0 else ()
            if rng is not None:
                rec = _InFlight(leaves, None, self.version, _Rerun(inputs, rng))
            else:
                rec = _InFlight(leaves, result, self.version)
            if held is not None:
                self._hold(rec, held)
            self._inflight[microbatch] = rec
            self._users[self.version] += 1
            self.peak_in_flight = max(self.peak_in_flight, len(self._inflight))
        return result

    def _hold(self, rec: _InFlight, held: _Held) -> None:
        """Count what ``rec`` keeps: what autograd saved (the pack hook added it), its inputs
        and outputs."""
        kept = _tensors_in(rec.rerun.inputs) if rec.rerun is not None else list(rec.inputs)
        kept += _tensors_in(rec.outputs)
        for t in kept:
            held.add(t)
        rec.held = held.storages
        for key, nbytes in held.storages.items():
            if self._live[key] == 0:
                self.saved_bytes += nbytes
            self._live[key] += 1
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)

    def _unhold(self, rec: _InFlight) -> None:
        for key, nbytes in (rec.held or {}).items():
            self._live[key] -= 1
            if self._live[key] == 0:
                del self._live[key]
                self.saved_bytes -= nbytes

    def _rerun(self, rec: _InFlight) -> tuple[Any, dict[str, torch.Tensor]]:
        """Run the forward of ``rec`` again, with a graph, at the weights its backward uses.

        Returns its outputs and the weights as leaves, whose ``.grad`` the backward fills.
        """
        assert rec.rerun is not None
        weights = {
            name: self.weight_at(p, rec.version).detach().requires_grad_(p.requires_grad)
            for name, p in self._named_params.items()
        }
        # copies: the rerun must not update running statistics (BatchNorm) a second time
        buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        with torch.enable_grad(), self._replayed(rec.rerun.rng), self._forward_context():
            outputs = torch.func.functional_call(
                self.module, {**weights, **buffers}, (rec.rerun.inputs,)
            )
        return outputs, weights

    @torch.no_grad()
    def _accumulate(self, weights: dict[str, torch.Tensor]) -> None:
        """Add the rerun's weight gradients to the parameters' ``.grad``, as autograd would."""
        for name, p in self._named_params.items():
            g = weights[name].grad
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def backward(
        self, microbatch: int, grads: Payload | None = None, scale: float = 1.0
    ) -> Payload:
        """Backward pass of ``microbatch``; returns the gradients of its inputs (None where none).

        Args:
            microbatch: a microbatch whose forward ran with ``grad=True``.
            grads: gradients of the stage's outputs, from the next stage; None on the last
                stage, whose forward returned a scalar loss.
            scale: factor on the loss (a microbatch's share of its minibatch).
        """
        rec = self._inflight.pop(microbatch)
        outputs, weights = rec.outputs, None
        if rec.rerun is not None:
            outputs, weights = self._rerun(rec)
        if grads is None:
            loss = outputs
            if loss.requires_grad:
                torch.autograd.backward(loss * scale)
        else:
            outs = tensors(outputs)
            pairs = [
                (o, g)
                for o, g in zip(outs, grads, strict=True)
                if g is not None and o.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if weights is not None:
            self._accumulate(weights)
        self._unhold(rec)
        self._release(rec.version)
        return tuple(x.grad if x.requires_grad else None for x in rec.inputs)

    # -- weight versions -----------------------------------------------------------------

    def _release(self, version: int) -> None:
        self._users[version] -= 1
        if self._users[version] == 0:
            del self._users[version]
            self._stash.pop(version, None)

    @torch.no_grad()
    def before_update(self) -> None:
        """Called right before the optimiser changes the weights in place."""
        if self.stashes and self._users[self.version] > 0:
            self._stash[self.version] = {i: p.detach().clone() for i, p in self._params.items()}
            self.peak_stashed_versions = max(self.peak_stashed_versions, len(self._stash))

    def rng_state(self) -> torch.Tensor | None:
        """This stage's random stream, to save with a checkpoint."""
        return None if self._rng is None else self._rng.clone()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        self._rng = None if state is None else state.clone()

    def after_update(self) -> None:
        self.version += 1

    @torch.no_grad()
    def predicted_weights(self, microbatch: int) -> list[torch.Tensor] | None:
        """Copies of the weights a training forward of ``microbatch`` runs with right now, when
        a correction moves them (weight prediction); None when the forward uses the live ones."""
        if self._forward_weights is None or not self.track:
            return None
        horizon = microbatch // self.microbatches - self.version
        with self._forward_weights(self.index, horizon):
            return [p.detach().clone() for p in self.module.parameters()]

    def forward_version(self, microbatch: int) -> int:
        """The weight version the forward of an in-flight ``microbatch`` ran with."""
        return self._inflight[microbatch].version

    @property
    def in_flight(self) -> int:
        """Microbatches whose forward ran and whose backward did not."""
        return len(self._inflight)

    @property
    def stashed_versions(self) -> int:
        """Weight versions held in copies (only ``pipedream`` makes any)."""
        return len(self._stash)
