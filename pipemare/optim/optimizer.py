"""The optimiser wrapper: steps a torch optimiser stage by stage, with staleness corrections."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from pipemare.optim.config import PipeMareConfig
from pipemare.optim.corrections import Correction, LRReschedule, StabilityGuard, StageView
from pipemare.optim.corrections.base import group_momentum, set_group_momentum
from pipemare.optim.settings import RunSettings, resolve
from pipemare.schedule.delay import StageDelay

__all__ = ["PipeMareOptimizer"]


class PipeMareOptimizer:
    """Wraps a user's ``torch.optim`` optimiser so each pipeline stage updates on its own clock.

    The user's optimiser keeps owning the parameters, their state (momentum, Adam moments)
    and the hyperparameters that LR schedulers drive; a stage's update runs the optimiser on
    that stage's parameters only. Update ``k`` uses the user's hyperparameters *from when
    minibatch k was fed*. On top of that the corrections the run's settings name
    (:class:`~pipemare.optim.settings.RunSettings`, :mod:`~pipemare.optim.corrections`) act
    per stage: T1 scales the rate, T2 corrects the backward's weights, weight prediction moves
    the forward's, spike compensation reshapes the update.

    T3 (synchronous warm-up) is the pipeline's schedule switch; here it means T1 counts its
    horizon from the first asynchronous step.

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over (at least) the stages' parameters.
        stage_params: for every stage this process runs, its parameters.
        delays: every stage's :class:`~pipemare.schedule.delay.StageDelay`, indexed by stage.
        config: which corrections to run, resolved for this optimiser, N and run length by
            :func:`~pipemare.optim.settings.resolve`; None, as there: the ``pipemare``
            schedule's default, said as a decision (ignored where ``settings`` is given).
        microbatches: N.
        total_steps: the run's optimiser steps (for T1's horizon as a fraction of the run).
        steps_per_epoch: optimiser steps per epoch (for T1's horizon in epochs).
        settings: the run's settings, already resolved (the Pipeline resolves them).

    Example:
        >>> from pipemare.schedule.delay import derive_delays
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> delays = derive_delays("pipemare", 2, 1)
        >>> opt = PipeMareOptimizer(sgd, {0: list(model[0].parameters()),
        ...                               1: list(model[1].parameters())}, delays)
        >>> opt.effective_lr(0, 0), opt.effective_lr(1, 0)
        (0.1, 0.1)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        delays: Sequence[StageDelay],
        config: PipeMareConfig | None = None,
        *,
        microbatches: int = 1,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        settings: RunSettings | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates the loss inside step(), which a pipeline cannot do; "
                "use a first-order optimiser (SGD, Adam, AdamW, ...)"
            )
        self.optimizer = optimizer
        if settings is None:
            settings = resolve(
                config,
                optimizer,
                delays=delays,
                microbatches=microbatches,
                total_steps=total_steps,
                steps_per_epoch=steps_per_epoch,
            )
        #: what the run does and why (:class:`~pipemare.optim.settings.RunSettings`)
        self.settings = settings
        self.config = settings.config
        self.delays = tuple(delays)
        owner = {id(p): stage for stage, ps in stage_params.items() for p in ps}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if owner and not held & set(owner):
            raise ValueError(
                "the optimiser holds none of the pipelined model's parameters, so nothing would "
                "train; build it over the model you pipeline, e.g. "
                "torch.optim.SGD(model.parameters(), lr=0.1)"
            )
        self._groups: dict[int, list[list[nn.Parameter]]] = {
            stage: [
                [p for p in g["params"] if owner.get(id(p)) == stage]
                for g in optimizer.param_groups
            ]
            for stage in stage_params
        }
        view = StageView(
            optimizer,
            {stage: self.stage_parameters(stage) for stage in stage_params},
            self.delays,
            microbatches,
            momentum=self.momentum,
        )
        self._view = view
        self.corrections: list[Correction] = settings.build()
        #: the stability guard, where it runs (its factor is every correction's strength)
        self.guard = cast(StabilityGuard | None, self.correction(StabilityGuard.name))
        if self.guard is not None:
            view.strength = self.guard.factor
        for c in self.corrections:
            c.bind(view)
        self._backward_movers = [
            c for c in self.corrections if type(c).backward_weight is not Correction.backward_weight
        ]
        # Hyperparameters of each group when minibatch k was fed, until every stage used them.
        self._hparams: dict[int, list[dict[str, Any]]] = {}
        self._waiting: dict[int, set[int]] = {}

    def correction(self, name: str) -> Correction | None:
        """The running correction called ``name`` (e.g. ``"stability_guard"``), or None."""
        return next((c for c in self.corrections if c.name == name), None)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimiser's parameter groups (what LR schedulers read and set)."""
        return self.optimizer.param_groups

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this optimiser steps (in one process: all of them)."""
        return tuple(self._groups)

    def record(self, minibatch: int) -> None:
        """Remember the user's hyperparameters for ``minibatch``; its updates will use them."""
        self._hparams[minibatch] = [
            {key: value for key, value in g.items() if key != "params"}
            for g in self.optimizer.param_groups
        ]
        self._waiting[minibatch] = set(self._groups)

    def lr_factor(self, stage: int, minibatch: int) -> float:
        """The corrections' factor on the user's LR for ``stage``'s update of ``minibatch``."""
        factor = 1.0
        for c in self.corrections:
            factor *= c.lr_factor(stage, minibatch)
        return factor

    def _user_settings(self, minibatch: int, group: int) -> Mapping[str, Any]:
        """Group ``group``'s settings recorded for ``minibatch``; without a record, today's."""
        hparams = self._hparams.get(minibatch)
        return hparams[group] if hparams else self.optimizer.param_groups[group]

    def momentum(self, stage: int, minibatch: int, group: int = 0) -> float:
        """The momentum ``stage``'s update of ``minibatch`` runs with (β1 of the Adam family,
        SGD's ``momentum``): the user's, as the corrections set it per stage."""
        m = group_momentum(self._user_settings(minibatch, group))
        for c in self.corrections:
            m = c.momentum(stage, minibatch, m)
        return m

    def effective_lr(self, stage: int, minibatch: int, group: int = 0) -> float:
        """The learning rate ``stage`` uses (or used) for the update of ``minibatch``."""
        base = self._user_settings(minibatch, group)["lr"]
        return float(base) * self.lr_factor(stage, minibatch)

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters ``stage`` updates, in its groups' order."""
        return [p for group in self._groups[stage] for p in group]

    def holds(self, stage: int, minibatch: int) -> bool:
        """Whether a correction holds ``stage``'s update of ``minibatch`` (local accumulation):
        :meth:`step` then applies nothing and the gradients stay for a later update."""
        return any(c.holds(stage, minibatch) for c in self.corrections)

    @torch.no_grad()
    def step(
        self,
        stage: int,
        minibatch: int,
        grad_norms: Mapping[nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        """Apply ``stage``'s update of ``minibatch`` from its accumulated gradients; clear them.
        A correction may hold the update (local accumulation): the gradients then stay.
        ``grad_norms``: each gradient's 2-norm, where the caller took them already (the engine's
        finite check); a correction that reads them (the stability guard) then takes no more."""
        params = self.stage_parameters(stage)
        if self.holds(stage, minibatch):
            self._used(stage, minibatch, params, clear=False)
            return
        self._view.grad_norms = grad_norms or {}
        try:
            for c in self.corrections:
                c.before_step(stage, params)
        finally:
            self._view.grad_norms = {}
        # Without a record (step() called directly), the user's current hyperparameters apply.
        hparams = self._hparams.get(minibatch) or [{}] * len(self.optimizer.param_groups)
        factor = self.lr_factor(stage, minibatch)
        saved, used = [], []
        for i, (g, stage_group, hp) in enumerate(
            zip(self.optimizer.param_groups, self._groups[stage], hparams, strict=True)
        ):
            saved.append(dict(g))
            g.update(hp)
            g["params"] = stage_group
            g["lr"] = g["lr"] * factor
            m = self.momentum(stage, minibatch, i)
            if m != group_momentum(g):
                set_group_momentum(g, m)
            settings = {k: v for k, v in g.items() if k != "params"}
            used += [settings] * len(stage_group)
        try:
            self.optimizer.step()
        finally:
            for g, old in zip(self.optimizer.param_groups, saved, strict=True):
                g.clear()
                g.update(old)
        for c in self.corrections:
            c.after_step(stage, minibatch, params, used)
        self._used(stage, minibatch, params)

    def skip(self, stage: int, minibatch: int) -> None:
        """Drop ``stage``'s gradients of ``minibatch`` without updating (they were not finite)."""
        self._used(stage, minibatch, self.stage_parameters(stage))

    def _used(
        self, stage: int, minibatch: int, params: Sequence[nn.Parameter], clear: bool = True
    ) -> None:
        """``stage`` is done with ``minibatch``: its gradients go (unless held), and the
        settings recorded for ``minibatch`` once every stage is done with it."""
        if clear:
            for p in params:
                p.grad = None
        waiting = self._waiting.get(minibatch)
        if waiting is not None:
            waiting.discard(stage)
            if not waiting:
                del self._waiting[minibatch], self._hparams[minibatch]

    @contextlib.contextmanager
    def forward_weights(self, stage: int, horizon: int) -> Iterator[None]:
        """Entered around ``stage``'s forward whose gradient lands ``horizon`` updates later."""
        with contextlib.ExitStack() as stack:
            for c in self.corrections:
                stack.enter_context(c.forward_weights(stage, horizon))
            yield

    @property
    def moves_backward_weights(self) -> bool:
        """Whether a correction gives backward passes other weights than the live ones (T2)."""
        return bool(self._backward_movers)

    def backward_weight(self, param: nn.Parameter, delta: int) -> torch.Tensor:
        """The weights the backward pass of a microbatch ``delta`` updates old should use."""
        for c in self._backward_movers:
            w = c.backward_weight(param, delta)
            if w is not None:
                return w
        return param.detach()

    def velocity(self, param: nn.Parameter) -> torch.Tensor | None:
        """T2's velocity δ of ``param`` as a new tensor; None before any update or with T2 off."""
        for c in self.corrections:
            v = c.velocity(param)
            if v is not None:
                return v
        return None

    def describe(self) -> str:
        """The corrections in effect and their settings, e.g. for a run's log."""
        return self.settings.describe()

    def buffer_bytes(self, stage: int) -> dict[str, int]:
        """Bytes of per-weight buffers each correction keeps for ``stage`` (its memory cost)."""
        return {c.name: c.buffer_bytes(stage) for c in self.corrections}

    def _index(self) -> dict[int, nn.Parameter]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return dict(enumerate(params))

    def state_dict(self, include_optimizer: bool = True) -> dict[str, Any]:
        """All state needed to resume: the optimiser's, the corrections' buffers, pending settings.

        Buffers are keyed by correction name, then by the parameter's position in the
        optimiser's param groups, as ``torch.optim`` keys its own state.
        ``include_optimizer=False`` leaves out the user's optimiser (for callers that save it
        themselves, like Lightning). "run" holds what was derived from the run's length (T1's
        horizon, :meth:`~pipemare.optim.settings.RunSettings.run_state`), which a resume keeps.
        """
        ids = {id(p): i for i, p in self._index().items()}
        state = {
            "buffers": {
                c.name: {ids[id(p)]: b for p, b in c.buffers().items()} for c in self.corrections
            },
            "hparams": {k: [dict(h) for h in hs] for k, hs in self._hparams.items()},
            "waiting": {k: sorted(s) for k, s in self._waiting.items()},
            "run": self.run_state(),
        }
        if include_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def run_state(self) -> dict[str, Any]:
        """What this run derived from its length (:meth:`RunSettings.run_state
        <pipemare.optim.settings.RunSettings.run_state>`), which a resume keeps."""
        return self.settings.run_state()

    def set_run_length(self, total_steps: int) -> int | None:
        """Run with the settings for a run now known to be ``total_steps`` long
        (:meth:`~pipemare.optim.settings.RunSettings.for_run_length`); returns T1's new horizon,
        or None where the run's length does not set it."""
        settings = self.settings.for_run_length(total_steps)
        if settings is self.settings:
            return None
        self._adopt(settings)
        return settings.horizon

    def _adopt(self, settings: RunSettings) -> None:
        """Run with ``settings``, which differ from these in T1's horizon and its basis only."""
        assert [c.name for c in settings.corrections] == [c.name for c in self.corrections]
        t1 = cast(LRReschedule | None, self.correction(LRReschedule.name))
        if t1 is not None and settings.horizon is not None:
            t1.horizon = settings.horizon
        self.settings = settings

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Restore :meth:`state_dict`; T1's horizon is the saved run's unless the config's
        settings for it changed (:meth:`~pipemare.optim.settings.RunSettings.resumed`).

        Returns:
            What differs from the saved run's derived settings (old and new value), for the
            caller to announce; empty when nothing does.
        """
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        index = self._index()
        mine = {id(p) for ps in self._groups.values() for g in ps for p in g}
        buffers = dict(state.get("buffers", {}))
        for c in self.corrections:
            c.load_buffers(
                {
                    index[int(i)]: b
                    for i, b in buffers.get(c.name, {}).items()
                    if id(index[int(i)]) in mine  # in a multi-process run: this process's stages
                }
            )
        self._hparams = {int(k): [dict(h) for h in hs] for k, hs in state["hparams"].items()}
        self._waiting = {int(k): set(s) for k, s in state["waiting"].items()}
        if "run" not in state:  # a checkpoint without the derived settings
            return []
        settings, notes = self.settings.resumed(state["run"])
        self._adopt(settings)
        return notes
