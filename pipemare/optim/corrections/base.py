"""The interface every staleness correction implements, and the state it is handed."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from pipemare.optim.chain import owner_of
from pipemare.schedule.delay import StageDelay

__all__ = [
    "Correction",
    "HParams",
    "Params",
    "StageView",
    "StepAverage",
    "StepAveraged",
    "foreach_pair",
    "group_momentum",
    "is_adam_family",
    "is_plain_sgd",
    "momentum_is_average",
    "set_group_momentum",
]

#: One stage's parameters, as a hook receives them.
Params = Sequence[nn.Parameter]

#: Per parameter, the param-group settings it was stepped with (learning rate included).
HParams = Sequence[Mapping[str, Any]]


def group_momentum(group: Mapping[str, Any]) -> float:
    """A param group's momentum: β1 of the Adam family, ``momentum`` of SGD (0 if none)."""
    if "betas" in group:
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0))


def momentum_is_average(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether a group's momentum buffer is an average of gradients (the Adam family's first
    moment, Muon's ``lerp``-ed buffer: the step stays about the rate whatever the momentum) or
    a sum (heavy-ball SGD: each gradient moves the weights ``lr/(1 - m)`` in total)."""
    owner = owner_of(optimizer, group)
    return "betas" in group or "use_muon" in group or isinstance(owner, torch.optim.Muon)


def is_muon(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether a group steps as Muon: MuonAdamW's ``use_muon`` groups, or torch's Muon (alone or
    chained)."""
    return bool(group.get("use_muon")) or isinstance(owner_of(optimizer, group), torch.optim.Muon)


def is_adam_family(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether a group steps as the Adam family does (``betas``: a first moment averaged and a
    step normalised by the second), not as Muon (:func:`is_muon`) or SGD."""
    return "betas" in group and not is_muon(optimizer, group)


def is_plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is torch's SGD without momentum in every group."""
    return type(optimizer) is torch.optim.SGD and all(
        not g.get("momentum", 0) for g in optimizer.param_groups
    )


def set_group_momentum(group: dict[str, Any], momentum: float) -> None:
    """Set a param group's momentum where :func:`group_momentum` reads it."""
    if "betas" in group:
        group["betas"] = (momentum, *tuple(group["betas"])[1:])
    else:
        group["momentum"] = momentum


@dataclasses.dataclass
class StageView:
    """What a correction may know of the stages this process runs.

    Attributes:
        optimizer: the user's optimiser (its param groups hold the hyperparameters, its
            ``state`` the moments a correction may read).
        params: stage -> its parameters.
        delays: every stage's delays, indexed by stage.
        microbatches: N.
        momentum: ``(stage, step) -> m``, the momentum a stage's update of minibatch ``step``
            runs with once every correction's :meth:`Correction.momentum` has had its say
            (default: the first param group's own).
        strength: ``stage -> s`` in (0, 1], how strongly the corrections act on a stage (the
            stability guard lowers it while the stage's gradients run away; default 1).
        grad_norms: during an update, each gradient's 2-norm where the engine took them already
            (its finite check), so a correction that reads them makes no second pass.
    """

    optimizer: torch.optim.Optimizer
    params: Mapping[int, Sequence[nn.Parameter]]
    delays: Sequence[StageDelay]
    microbatches: int
    momentum: Callable[[int, int], float] | None = None
    strength: Callable[[int], float] | None = None
    grad_norms: Mapping[nn.Parameter, torch.Tensor] = dataclasses.field(default_factory=dict)

    def grad_norm(self, params: Params) -> float:
        """The 2-norm of ``params``' gradients (those that have one): from :attr:`grad_norms`
        where it holds each of them, else in one fused pass."""
        with_grad = [p for p in params if p.grad is not None]
        known = self.grad_norms
        if known and all(p in known for p in with_grad):
            norms = [known[p] for p in with_grad]
        else:
            norms = list(torch._foreach_norm([p.grad for p in with_grad if p.grad is not None]))
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def stage_strength(self, stage: int) -> float:
        """How strongly the corrections act on ``stage`` now (``strength``; 1 without it)."""
        return 1.0 if self.strength is None else self.strength(stage)

    def stage_momentum(self, stage: int, step: int) -> float:
        """The momentum of ``stage``'s update of minibatch ``step`` (``momentum``; without it,
        the first param group's own)."""
        if self.momentum is None:
            return group_momentum(self.optimizer.param_groups[0])
        return self.momentum(stage, step)


class Correction:
    """One staleness correction, applied per stage by :class:`~pipemare.PipeMareOptimizer`.

    Every hook has a neutral default, so a technique overrides only what it changes:

    - :meth:`lr_factor` scales the learning rate of a stage's update (T1);
    - :meth:`holds` keeps a stage's gradients for a later update (local accumulation);
    - :meth:`momentum` sets the momentum of a stage's update (delay-aware momentum);
    - :meth:`before_step` / :meth:`after_step` run around the user's optimiser step of one
      stage, with that stage's gradients still in place (T2's velocity, spike compensation);
    - :meth:`forward_weights` is entered around a training forward pass and may move the
      weights *in place* for its duration (weight prediction); it must restore them;
    - :meth:`backward_weight` gives the weights a delayed backward pass uses (T2).

    A correction may keep at most one buffer per weight (:meth:`buffer_bytes` reports it);
    none stashes weight versions.
    """

    name: ClassVar[str] = ""
    derived_for: ClassVar[str] = ""
    """The optimiser families the correction's formula was derived for, and what it does on the
    others (the documentation's table of corrections by optimiser, under "Every optimiser" on the
    Schedules and corrections page, is built from these)."""
    start: int = 0
    """The first step it applies to (T3's warm-up steps have no delay)."""

    def bind(self, view: StageView) -> None:
        """Called once, when the optimiser wrapper is built (whether the correction runs, and
        with which settings, was decided before: :func:`pipemare.optim.settings.resolve`)."""
        self.view = view

    def _applies(self, step: int) -> bool:
        """Whether the correction acts on the update of minibatch ``step``."""
        return step >= self.start

    def lr_factor(self, stage: int, step: int) -> float:
        """The factor on ``stage``'s learning rate for its update of minibatch ``step``."""
        return 1.0

    def holds(self, stage: int, minibatch: int) -> bool:
        """Whether ``stage`` keeps its gradients of ``minibatch`` for a later update instead of
        updating now (local accumulation); the other hooks do not run for a held update."""
        return False

    def momentum(self, stage: int, step: int, momentum: float) -> float:
        """The momentum ``stage``'s update of minibatch ``step`` runs with, given the one it
        would run with otherwise (the user's, or an earlier correction's)."""
        return momentum

    def before_step(self, stage: int, params: Params) -> None:
        """Before the user's optimiser steps ``stage``, with its gradients in place."""
        return None

    def after_step(self, stage: int, minibatch: int, params: Params, hparams: HParams) -> None:
        """After ``stage``'s update of ``minibatch``; ``hparams``: per parameter, the group
        settings it was just stepped with (learning rate included)."""
        return None

    @contextlib.contextmanager
    def forward_weights(self, stage: int, horizon: int) -> Iterator[None]:
        """Around a forward whose gradient will be applied ``horizon`` updates from now."""
        yield

    def backward_weight(self, param: nn.Parameter, delta: int) -> torch.Tensor | None:
        """Weights for a backward ``delta`` updates after its forward; None: not this one's."""
        return None

    def velocity(self, param: nn.Parameter) -> torch.Tensor | None:
        """The recent step of ``param`` the backward corrects by (T2's δ); None: not this one's."""
        return None

    def buffers(self) -> dict[nn.Parameter, torch.Tensor]:
        """The per-weight buffers this correction keeps, as it keeps them (checkpoints, memory)."""
        return {}

    def load_buffers(self, buffers: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Restore buffers that :meth:`buffers` returned (a checkpoint's)."""
        return None

    def keeps_copy(self, stage: int) -> bool:
        """Whether this correction keeps a buffer the size of ``stage``'s trained weights (the
        memory a stage's prediction counts before its first step)."""
        return False

    def buffer_bytes(self, stage: int) -> int:
        """The bytes of the buffers this correction keeps for ``stage``'s parameters."""
        mine = {id(p) for p in self.view.params.get(stage, ())}
        return sum(b.numel() * b.element_size() for p, b in self.buffers().items() if id(p) in mine)


@torch.no_grad()
def foreach_pair(
    targets: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    fused: Callable[[list[torch.Tensor], list[torch.Tensor]], object],
    single: Callable[[torch.Tensor, torch.Tensor], object],
) -> None:
    """An in-place update of each target by its source: one ``fused`` call over the pairs of
    one dtype (the per-tensor cost matters on small layers), then ``single`` on each other pair
    with the source cast to its target's dtype (low-precision weights, float32 buffers)."""
    same = [(t, s) for t, s in zip(targets, sources, strict=True) if t.dtype == s.dtype]
    if same:
        fused([t for t, _ in same], [s for _, s in same])
    for t, s in zip(targets, sources, strict=True):
        if t.dtype != s.dtype:
            single(t, s.to(t.dtype))


class StepAverage:
    """An exponential average of each weight's recent optimiser steps, in one buffer per weight.

    ``δ ← γ δ + (1 - γ)(w_new - w_old)`` is split around the step so no copy of ``w_old`` is
    kept: on ``u = -δ``, ``u ← γu + (1-γ) w_old`` before and ``u ← u - (1-γ) w_new`` after
    (two fused passes; the rounding this adds is about 2^-24 |w| in float32). T2 and weight
    prediction both average steps this way, each with its own decay.
    """

    def __init__(self) -> None:
        self.neg: dict[nn.Parameter, torch.Tensor] = {}

    def _buffer(self, p: nn.Parameter) -> torch.Tensor:
        u = self.neg.get(p)
        if u is None:
            dtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
            u = self.neg[p] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return u

    def before(self, params: Params, gamma: float) -> None:
        """The half of the update that runs before the optimiser step: ``u ← γu + (1-γ) w_old``
        (with γ = 0 a copy, which reads the weights alone: the same numbers as the lerp)."""
        buffers = [self._buffer(p) for p in params]
        if gamma == 0.0:
            foreach_pair(buffers, params, torch._foreach_copy_, lambda u, p: u.copy_(p))
            return
        foreach_pair(
            buffers,
            params,
            lambda us, ps: torch._foreach_lerp_(us, ps, 1.0 - gamma),
            lambda u, p: u.lerp_(p, 1.0 - gamma),
        )

    def after(self, params: Params, gamma: float) -> None:
        """The half that runs after it: ``u ← u - (1-γ) w_new``, leaving ``u = -δ``."""
        foreach_pair(
            [self.neg[p] for p in params],
            params,
            lambda us, ps: torch._foreach_sub_(us, ps, alpha=1.0 - gamma),
            lambda u, p: u.sub_(p, alpha=1.0 - gamma),
        )

    def velocity(self, p: nn.Parameter) -> torch.Tensor | None:
        """δ as a new tensor; None before the weight's first update."""
        u = self.neg.get(p)
        return None if u is None else -u


class StepAveraged(Correction):
    """A correction built on a :class:`StepAverage` (its one buffer per weight, checkpointed),
    which it updates around every step of the stages :meth:`_step_decay` names."""

    def __init__(self) -> None:
        self.steps = StepAverage()

    def _step_decay(self, stage: int) -> float | None:
        """γ of ``stage``'s step average; None: the stage keeps none."""
        raise NotImplementedError

    def keeps_copy(self, stage: int) -> bool:
        return self._step_decay(stage) is not None

    def before_step(self, stage: int, params: Params) -> None:
        gamma = self._step_decay(stage)
        if gamma is not None:
            self.steps.before(params, gamma)

    def after_step(self, stage: int, minibatch: int, params: Params, hparams: HParams) -> None:
        gamma = self._step_decay(stage)
        if gamma is not None:
            self.steps.after(params, gamma)

    def buffers(self) -> dict[nn.Parameter, torch.Tensor]:
        return self.steps.neg  # -δ: see StepAverage

    def load_buffers(self, buffers: Mapping[nn.Parameter, torch.Tensor]) -> None:
        self.steps.neg = {p: b.to(p.device) for p, b in buffers.items()}
