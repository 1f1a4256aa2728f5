"""One pipeline stage: forward and backward of microbatches without stashing weights.

A stage saves activations as autograd does but its parameters by reference, so a delayed
backward pass sees the weights of its own time (:mod:`pipemare.engine.nostash`: live, T2's
correction, or PipeDream's copy-on-write stash); with ``recompute`` it keeps a microbatch's
inputs only and reruns the forward at backward time (:mod:`pipemare.engine.recompute`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipemare.engine.memory import Held, SavedBytes, Storages
from pipemare.engine.nostash import SavedTensors, Stash, same_versions, set_versions, versions
from pipemare.engine.payload import Payload, as_payload, leaves, tensors, tensors_in
from pipemare.engine.randomness import RandomStream, RngState
from pipemare.engine.recompute import Rerun, accumulate, rerun

__all__ = ["Stage", "as_payload", "tensors"]


@dataclasses.dataclass
class _InFlight:
    inputs: tuple[torch.Tensor, ...]  # leaves whose gradients backward returns
    outputs: Any  # None when the forward will be rerun
    version: int
    rerun: Rerun | None = None
    held: Storages | None = None  # storage -> bytes, if measured


class Stage:
    """Runs one stage's layers for forward and backward passes of microbatches.

    Args:
        index: this stage's position, 0..P-1.
        module: the stage's layers.
        stashes: keep the forward's weight version for the backward (PipeDream).
        track: save parameters by reference so updates may run between forward and backward.
            Flushing schedules never update in between and skip the hooks.
        backward_weight: ``(param, delta)`` -> the weights a backward pass ``delta`` updates
            after its forward should use (T2's correction); None: the live weights. A tracking
            stage with the live weights, no stash and no compiler needs no saved-tensor hook
            (:attr:`by_version`).
        forward_context: a context manager factory entered around every forward (autocast).
        forward_weights: ``(stage, horizon)`` -> a context manager entered around every
            training forward whose gradient will be applied ``horizon`` updates later; it may
            move the weights in place for the forward's duration (weight prediction).
        microbatches: N, to tell which update a microbatch's gradient feeds.
        seed: seed of this stage's own random stream (dropout draws the same numbers whether
            the stages share a process or not).
        recompute: keep only each microbatch's inputs and rerun the forward at backward time
            (activation recomputation; :mod:`pipemare.engine.recompute` says which gradient
            it gives). The forward whose output goes downstream runs as usual, under
            ``forward_weights`` (weight prediction) and without a graph; the rerun runs under
            ``forward_context`` at :meth:`weight_at`'s weights, with the random numbers the
            forward drew (same dropout masks) and on copies of the module's buffers, so
            BatchNorm's running statistics update once. Forward hooks do run twice. A forward
            with a ``head`` (the last stage's loss and metrics) never reruns, so logging and
            metric updates run once.
        measure_saved: count the bytes held for in-flight microbatches (:attr:`saved_bytes`,
            :attr:`peak_saved_bytes`). Default: on where it costs next to nothing (the stage's
            pack hook runs anyway: it stashes, corrects its backward's weights or is compiled;
            or it recomputes). Elsewhere counting needs a Python hook on every saved tensor,
            which costs 8-10% of a forward and backward (:mod:`pipemare.engine.nostash`).
        compile: ``torch.compile``'s options to compile the stage's forward with, or None.
            ``module`` itself stays as it is (its parameter names too); the rerun of
            ``recompute`` runs it uncompiled. The compiled forward saves for its backward what
            AOTAutograd chooses, through the same hooks: parameters it saves are still saved
            by reference, so the no-stash backward is unchanged (the hooks themselves run
            uncompiled).

    Attributes:
        by_version: autograd saves the parameters itself and the engine keeps their versions
            across its own writes to them (the update, weight prediction, a tied copy's
            install): :mod:`pipemare.engine.nostash` says why this needs no hook.
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
        compile: dict[str, Any] | None = None,
    ) -> None:
        self.index = index
        self.module = module
        # what the forward calls; ``module`` keeps its own names (state dicts, the rerun)
        self._call = module if compile is None else torch.compile(module, **compile)
        self.version = 0
        self.stashes = stashes
        self.track = track
        self._backward_weight = backward_weight or (lambda p, _delta: p.detach())
        self._forward_context = forward_context or contextlib.nullcontext
        self._forward_weights = forward_weights
        self.microbatches = microbatches
        self._params = {id(p): p for p in module.parameters()}
        self._named_params = dict(module.named_parameters())
        #: parameters frozen when the stage is built (a LoRA model's base): no update changes
        #: them, so they never need another version (no stash copy, no corrected weights)
        self._frozen = {i for i, p in self._params.items() if not p.requires_grad}
        buffers = {id(b): b for b in module.buffers()}
        self._saved = SavedTensors(self._params, buffers, self.weight_at, compile is not None)
        #: parameters saved by autograd itself, their versions kept across the engine's own
        #: writes: the backward sees the live weights as they are (no stash, no correction)
        self.by_version = track and not stashes and backward_weight is None and compile is None
        self._kept: list[int | None] = []
        trained = {i: p for i, p in self._params.items() if i not in self._frozen}
        self._weights = list(trained.values())  # what the engine writes in place (frozen: never)
        self._stash = Stash(trained)
        self.recompute = recompute
        hooked = track and not self.by_version
        self.measure_saved = (hooked or recompute) if measure_saved is None else measure_saved
        self._bytes = SavedBytes()
        self._inflight: dict[int, _InFlight] = {}
        self.peak_in_flight = 0
        self._random = RandomStream(seed)

    def weight_at(self, param: nn.Parameter, version: int) -> torch.Tensor:
        """What a backward pass sees of ``param`` for a microbatch forwarded at ``version``."""
        if id(param) in self._frozen:
            return param.detach()
        if self.stashes:
            if version == self.version:
                return param.detach()
            return self._stash.weight(param, version)
        return self._backward_weight(param, self.version - version)

    # -- forward / backward --------------------------------------------------------------

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
            inputs = leaves(as_payload(inputs, self.index - 1))
        reruns = grad and self.recompute and head is None
        held = Held() if grad and self.measure_saved else None
        hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        weights: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if grad and self.track and self._forward_weights is not None:
            # the update this microbatch's gradient feeds, counted from the live version
            horizon = microbatch // self.microbatches - self.version
            weights = self._forward_weights(self.index, horizon)
            if self.by_version:
                weights = self._unseen(weights)
        if grad and not reruns and ((self.track and not self.by_version) or self.measure_saved):
            hooks = self._saved.hooks(self.version, self.track, held)
        rng = self._random.now(self._params.values(), inputs) if reruns else None  # before use
        with (
            torch.set_grad_enabled(grad and not reruns),
            self._random.active(),
            weights,
            hooks,
            self._forward_context(),
        ):
            outputs = self._call(inputs)
            result = head(outputs) if head is not None else outputs
        if grad:
            self._keep(microbatch, inputs, result, rng, held)
        return result

    def _keep(
        self, microbatch: int, inputs: Any, result: Any, rng: RngState | None, held: Held | None
    ) -> None:
        """Hold ``microbatch`` in flight until its backward: its outputs, or (with ``rng``) what
        its rerun needs. Count what it keeps into ``held``, where autograd's part already is."""
        grad_of = tensors(inputs) if self.index > 0 else ()
        if rng is not None:
            rec = _InFlight(grad_of, None, self.version, Rerun(inputs, rng))
        else:
            rec = _InFlight(grad_of, result, self.version)
        if held is not None:
            kept = tensors_in(rec.rerun.inputs) if rec.rerun is not None else list(rec.inputs)
            rec.held = self._bytes.hold(held, kept + tensors_in(rec.outputs))
        self._inflight[microbatch] = rec
        self._stash.hold(self.version)
        self.peak_in_flight = max(self.peak_in_flight, len(self._inflight))

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
            outputs, weights = rerun(
                self.module,
                self._named_params,
                lambda p: self.weight_at(p, rec.version),
                rec.rerun,
                self._forward_context,
            )
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
            accumulate(self._named_params, weights)
        self._bytes.release(rec.held)
        self._stash.release(rec.version)
        return tuple(x.grad if x.requires_grad else None for x in rec.inputs)

    # -- weight versions -----------------------------------------------------------------

    def before_update(self) -> None:
        """Called right before the optimiser changes the weights in place."""
        if self.stashes:
            self._stash.before_update(self.version)
        if self.by_version:
            self._kept = versions(self._weights)

    def after_update(self) -> None:
        if self.by_version:
            set_versions(self._weights, self._kept)
        self.version += 1

    @contextlib.contextmanager
    def _unseen(self, weights: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        """``weights`` (weight prediction's move and undo) with the weights' versions as they
        were, inside and after: the forward saves them at those versions."""
        with same_versions(self._weights) as restore, weights:
            restore()
            yield

    def rng_state(self) -> torch.Tensor | None:
        """This stage's random stream, to save with a checkpoint."""
        return self._random.state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        self._random.set_state(state)

    @torch.no_grad()
    def predicted_weights(self, microbatch: int) -> list[torch.Tensor] | None:
        """Copies of the weights a training forward of ``microbatch`` runs with right now, when
        a correction moves them (weight prediction); None when the forward uses the live ones."""
        if self._forward_weights is None or not self.track:
            return None
        horizon = microbatch // self.microbatches - self.version
        with self._unseen(self._forward_weights(self.index, horizon)):
            params = self.module.parameters()
            return [p.detach().clone() if p.requires_grad else p.detach() for p in params]

    def forward_version(self, microbatch: int) -> int:
        """The weight version the forward of an in-flight ``microbatch`` ran with."""
        return self._inflight[microbatch].version

    @property
    def in_flight(self) -> int:
        """Microbatches whose forward ran and whose backward did not."""
        return len(self._inflight)

    @property
    def saved_bytes(self) -> int:
        return self._bytes.now

    @property
    def peak_saved_bytes(self) -> int:
        return self._bytes.peak

    @property
    def stashed_versions(self) -> int:
        """Weight versions held in copies (only ``pipedream`` makes any)."""
        return len(self._stash)

    @property
    def peak_stashed_versions(self) -> int:
        """The most weight versions held in copies at once so far."""
        return self._stash.peak

    @property
    def peak_stashed_bytes(self) -> int:
        """The most bytes those copies held at once so far (copies of trained weights only)."""
        return self._stash.peak_bytes
