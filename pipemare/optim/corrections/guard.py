"""A stability guard: backs a stage's rate and corrections off while its gradients run away.

Delayed gradient descent on a quadratic of curvature λ is stable only while ``αλ`` stays below
``2 sin(π/(4τ+2))``, and heavy-ball momentum shrinks that range further
(:func:`pipemare.optim.stability.delayed_momentum_bound`). Outside it the iteration grows
geometrically, and the first place it shows is the size of the gradients a stage receives,
whatever the optimiser. The guard watches them at every update of every stage and, when their
recent average exceeds ``threshold`` times their long-run one, halves the stage's learning-rate
factor and the strength of the corrections that act on it (weight prediction's horizon, spike
compensation's delay, delay-aware momentum's rise: :meth:`StageView.stage_strength`), down to
``floor``. ``recovery`` updates after the last halving the factor doubles back, up to 1. A run
that stays calm is never touched; a real divergence is stopped by the halvings, which come
every ``refractory`` updates while the growth lasts. T1 is left alone: it never raises a rate.

The update/weight ratio is the other natural signal, but without a copy of the old weights it
is known only where weight prediction keeps the last step; the gradient norm is known for every
optimiser, costs one fused norm per stage and update, and grows with the same rate.

Its state is five numbers per stage (the two averages, the factor, the updates since the last
change and the updates seen), kept in a
small tensor keyed by the stage's first parameter, so checkpoints and snapshots carry it as
they carry the per-weight buffers of the other corrections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from pipemare.optim.corrections.base import Correction, Params

__all__ = ["StabilityGuard"]

_FAST, _SLOW, _FACTOR, _SINCE, _SEEN = range(5)


class StabilityGuard(Correction):
    """Halves a stage's rate and corrections while its recent gradient norms run above
    ``threshold`` times their long-run average; doubles them back after ``recovery`` calm
    updates.

    Two running averages of the stage's gradient norm are kept, a fast one (``fast`` decay, about
    ten updates) and a slow one (``slow``, about a hundred), both corrected for their start. A
    delayed iteration that has left its stable range grows by a factor ``r`` per update, and
    their ratio settles at ``(1 - slow/r)(1 - fast)/((1 - fast/r)(1 - slow))``: above the
    default threshold 3 from ``r`` ≈ 1.03, so a growth of 3% or more per update is caught within
    a few dozen updates, while the noise of single minibatches averages out in both (a trigger
    on single norms, tried first, fired on the ordinary spread of SGD's minibatch gradients and
    slowed calm runs). Slower growth goes unseen; a blow-up within a few updates (a rate far
    beyond the stable one) is faster than any average. After a halving the guard waits
    ``refractory`` updates to see its effect before it halves again.

    Args:
        threshold: the ratio of the fast to the slow average that counts as a runaway.
        fast: the fast average's decay per update.
        slow: the slow average's decay per update.
        warmup: updates of a stage before the guard may act.
        refractory: updates after a halving before the next one.
        recovery: updates after the last halving before the factor doubles back (and again
            after each such doubling), up to 1.
        floor: the smallest factor.
        start: the first step it applies to (T3's warm-up steps have no delay).
    """

    name = "stability_guard"
    derived_for = "any optimiser: it reads gradient norms"

    def __init__(
        self,
        threshold: float = 3.0,
        fast: float = 0.9,
        slow: float = 0.99,
        warmup: int = 50,
        refractory: int = 3,
        recovery: int = 100,
        floor: float = 1.0 / 64,
        start: int = 0,
    ) -> None:
        if threshold <= 1.0:
            raise ValueError(f"the guard's threshold must be > 1, got {threshold}")
        if not 0.0 <= fast < slow < 1.0:
            raise ValueError(f"the guard needs 0 <= fast < slow < 1, got {fast} and {slow}")
        self.threshold, self.fast, self.slow = threshold, fast, slow
        self.warmup, self.refractory, self.recovery = warmup, refractory, recovery
        self.floor, self.start = floor, start
        self.state: dict[nn.Parameter, torch.Tensor] = {}
        self._factors: dict[int, tuple[torch.Tensor, int, float]] = {}  # factor() at every action
        self.backoffs: dict[int, int] = {}
        """Halvings per stage in this process since it was built (for logs and tests)."""

    def _stage_state(self, stage: int) -> torch.Tensor | None:
        params = self.view.params.get(stage)
        if not params:
            return None
        first = params[0]
        s = self.state.get(first)
        if s is None:
            s = self.state[first] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
        return s

    def factor(self, stage: int) -> float:
        """The stage's current factor on its rate and its corrections' strength."""
        s = self._stage_state(stage)
        if s is None:
            return 1.0
        # read at every action of the stage: kept as a float beside the tensor (which holds it
        # for checkpoints) until the tensor changes in place (its version counter moves)
        cached = self._factors.get(id(s))
        if cached is None or cached[0] is not s or cached[1] != s._version:
            cached = self._factors[id(s)] = (s, s._version, float(s[_FACTOR]))
        return cached[2]

    def ratio(self, stage: int) -> float:
        """The stage's fast average of gradient norms over its slow one (1 before any)."""
        s = self._stage_state(stage)
        return 1.0 if s is None else self._ratio(s.tolist())

    def _ratio(self, values: list[float]) -> float:
        seen = int(values[_SEEN])
        if seen == 0:
            return 1.0
        fast = values[_FAST] / (1 - self.fast**seen)
        slow = values[_SLOW] / (1 - self.slow**seen)
        return fast / slow if slow > 0 else 1.0

    @torch.no_grad()
    def before_step(self, stage: int, params: Params) -> None:
        """Update the stage's two averages of the gradient norm; halve or restore its factor."""
        s = self._stage_state(stage)
        if s is None or all(p.grad is None for p in params):
            return
        norm = self.view.grad_norm(params)
        if not math.isfinite(norm):
            return  # the engine refuses a non-finite update on its own
        v = s.tolist()  # the arithmetic in Python floats (float64, as the tensor), written once
        seen = int(v[_SEEN])
        v[_FAST] = self.fast * v[_FAST] + (1 - self.fast) * norm
        v[_SLOW] = self.slow * v[_SLOW] + (1 - self.slow) * norm
        v[_SEEN] += 1
        v[_SINCE] += 1
        since = int(v[_SINCE])
        ready = seen >= self.warmup and since > self.refractory
        if ready and self._ratio(v) > self.threshold:
            v[_FACTOR] = max(v[_FACTOR] / 2, self.floor)
            v[_SINCE] = 0
            self.backoffs[stage] = self.backoffs.get(stage, 0) + 1
        elif since >= self.recovery and v[_FACTOR] < 1.0:
            v[_FACTOR] = min(v[_FACTOR] * 2, 1.0)
            v[_SINCE] = 0
        s.copy_(torch.tensor(v, dtype=torch.float64))
        self._factors[id(s)] = (s, s._version, v[_FACTOR])

    def lr_factor(self, stage: int, step: int) -> float:
        """The stage's current factor, between ``floor`` and 1."""
        return self.factor(stage) if self._applies(step) else 1.0

    def buffers(self) -> dict[nn.Parameter, torch.Tensor]:
        return self.state

    def load_buffers(self, buffers: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Restore the per-stage averages and factors from a checkpoint."""
        self.state = {p: b.detach().to(torch.float64).cpu().clone() for p, b in buffers.items()}
        self._factors.clear()
