"""The PipeMare optimiser wrapper: steps any torch optimiser one stage at a time, with T1 and T2."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipemare import correction
from pipemare.config import PipeMareConfig
from pipemare.delay import StageDelay

__all__ = ["PipeMareOptimizer"]


class PipeMareOptimizer:
    """Wraps a user's ``torch.optim`` optimiser so each pipeline stage updates on its own clock.

    The user's optimiser keeps owning the parameters, their state (momentum, Adam moments)
    and the hyperparameters that LR schedulers drive; a stage's update runs the optimiser on
    that stage's parameters only. On top of that it applies, per stage:

    - T1: the learning rate of update ``k`` is the user's rate *when minibatch k was fed*,
      times :func:`~pipemare.correction.lr_factor` of the stage's forward delay;
    - T2: one velocity buffer per weight, from which the backward pass estimates the
      forward-time weights (:meth:`backward_weight`).

    T3 (synchronous warm-up) is the pipeline's schedule switch; here it means T1 counts its
    horizon from the first asynchronous step.

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over (at least) the stages' parameters.
        stage_params: for every stage this process runs, its parameters.
        delays: every stage's :class:`~pipemare.delay.StageDelay`, indexed by stage.
        config: which techniques run.

    Example:
        >>> from pipemare.delay import derive_delays
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
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates the loss inside step(), which a pipeline cannot do; "
                "use a first-order optimiser (SGD, Adam, AdamW, ...)"
            )
        self.optimizer = optimizer
        self.config = config if config is not None else PipeMareConfig()
        self.delays = tuple(delays)
        owner = {id(p): stage for stage, ps in stage_params.items() for p in ps}
        self._groups: dict[int, list[list[nn.Parameter]]] = {
            stage: [
                [p for p in g["params"] if owner.get(id(p)) == stage]
                for g in optimizer.param_groups
            ]
            for stage in stage_params
        }
        self._gamma = {
            stage: correction.velocity_decay(
                self.delays[stage].discrepancy, self.config.discrepancy_decay
            )
            for stage in stage_params
        }
        # T2 keeps u = -δ (one buffer per weight): the update around a step is then two fused
        # passes, u.lerp_(w_old, 1-γ) before and u -= (1-γ) w_new after.
        self._neg_velocity: dict[nn.Parameter, torch.Tensor] = {}
        # Hyperparameters of each group when minibatch k was fed, until every stage used them.
        self._hparams: dict[int, list[dict[str, Any]]] = {}
        self._waiting: dict[int, set[int]] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(self._groups)

    def record(self, minibatch: int) -> None:
        """Remember the user's hyperparameters for ``minibatch``; its updates will use them."""
        self._hparams[minibatch] = [
            {key: value for key, value in g.items() if key != "params"}
            for g in self.optimizer.param_groups
        ]
        self._waiting[minibatch] = set(self._groups)

    def lr_factor(self, stage: int, minibatch: int) -> float:
        """T1's factor on the user's learning rate for ``stage``'s update of ``minibatch``."""
        cfg = self.config
        if not cfg.lr_reschedule or minibatch < cfg.warmup_steps:
            return 1.0
        return correction.lr_factor(
            self.delays[stage].forward, minibatch - cfg.warmup_steps, cfg.reschedule_steps
        )

    def effective_lr(self, stage: int, minibatch: int, group: int = 0) -> float:
        """The learning rate ``stage`` uses (or used) for the update of ``minibatch``."""
        hparams = self._hparams.get(minibatch)
        base = hparams[group]["lr"] if hparams else self.optimizer.param_groups[group]["lr"]
        return float(base) * self.lr_factor(stage, minibatch)

    def _t2_active(self, stage: int) -> bool:
        # Stages whose backward is not behind their forward (the last one) need no velocity.
        return self.config.discrepancy_correction and self.delays[stage].discrepancy > 0

    def _buffer(self, p: nn.Parameter) -> torch.Tensor:
        u = self._neg_velocity.get(p)
        if u is None:
            dtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
            u = self._neg_velocity[p] = torch.zeros_like(p, dtype=dtype)
        return u

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        return [p for group in self._groups[stage] for p in group]

    @torch.no_grad()
    def step(self, stage: int, minibatch: int) -> None:
        """Apply ``stage``'s update of ``minibatch`` from its accumulated gradients; clear them."""
        params = self.stage_parameters(stage)
        t2, gamma = self._t2_active(stage), self._gamma.get(stage, 0.0)
        if t2:
            # δ ← γδ + (1-γ)(w_new - w_old) split around the step, so no copy of w_old is kept
            # (on u = -δ): u ← γu + (1-γ)w_old now, u ← u - (1-γ)w_new after. The rounding
            # this adds is about 2^-24 |w| in float32.
            for p in params:
                u = self._buffer(p)
                u.lerp_(p if p.dtype == u.dtype else p.to(u.dtype), 1.0 - gamma)
        # Without a record (step() called directly), the user's current hyperparameters apply.
        hparams = self._hparams.get(minibatch) or [{}] * len(self.optimizer.param_groups)
        factor = self.lr_factor(stage, minibatch)
        saved = []
        for g, stage_group, hp in zip(
            self.optimizer.param_groups, self._groups[stage], hparams, strict=True
        ):
            saved.append(dict(g))
            g.update(hp)
            g["params"] = stage_group
            g["lr"] = g["lr"] * factor
        try:
            self.optimizer.step()
        finally:
            for g, old in zip(self.optimizer.param_groups, saved, strict=True):
                g.clear()
                g.update(old)
        if t2:
            for p in params:
                self._neg_velocity[p].sub_(p, alpha=1.0 - gamma)
        for p in params:
            p.grad = None
        waiting = self._waiting.get(minibatch)
        if waiting is not None:
            waiting.discard(stage)
            if not waiting:
                del self._waiting[minibatch], self._hparams[minibatch]

    def backward_weight(self, param: nn.Parameter, delta: int) -> torch.Tensor:
        """The weights the backward pass of a microbatch ``delta`` updates old should use."""
        u = self._neg_velocity.get(param) if self.config.discrepancy_correction else None
        if delta <= 0 or u is None:
            return param.detach()
        return correction.backward_weight(param.detach(), u, -float(delta))

    def velocity(self, param: nn.Parameter) -> torch.Tensor | None:
        """T2's velocity δ of ``param`` as a new tensor; None before any update or with T2 off."""
        u = self._neg_velocity.get(param)
        return None if u is None else -u

    def _index(self) -> dict[int, nn.Parameter]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return dict(enumerate(params))

    def state_dict(self, include_optimizer: bool = True) -> dict[str, Any]:
        """All state needed to resume: the optimiser's, T2's velocities, pending hyperparameters.

        Velocities are keyed by the parameter's position in the optimiser's param groups, as
        ``torch.optim`` keys its own state. ``include_optimizer=False`` leaves out the user's
        optimiser (for callers that save it themselves, like Lightning).
        """
        ids = {id(p): i for i, p in self._index().items()}
        state = {
            "velocity": {ids[id(p)]: -u for p, u in self._neg_velocity.items()},
            "hparams": {k: [dict(h) for h in hs] for k, hs in self._hparams.items()},
            "waiting": {k: sorted(s) for k, s in self._waiting.items()},
        }
        if include_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        index = self._index()
        mine = {id(p) for ps in self._groups.values() for g in ps for p in g}
        self._neg_velocity = {
            index[int(i)]: -v.to(device=index[int(i)].device)
            for i, v in state["velocity"].items()
            if id(index[int(i)]) in mine  # in a multi-process run: this process's stages only
        }
        self._hparams = {int(k): [dict(h) for h in hs] for k, hs in state["hparams"].items()}
        self._waiting = {int(k): set(s) for k, s in state["waiting"].items()}
