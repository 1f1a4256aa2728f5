"""Delay-aware momentum: the weight-stash-free form of the Nesterov method of Ajanthan et al.,
"Nesterov Method for Asynchronous Pipeline Parallel Optimization" (ICML 2025).

Their method keeps Nesterov's look-ahead and discounts the stale gradient by ``1 - γ``:
``w_{t+1} = w_t + d_t - η (1 - γ) ∇f(w_{t-τ} + d_{t-τ})`` with ``d_t = γ (w_t - w_{t-1})``.
As ``γ → 1`` the look-ahead step ``d_t``, built from fresh history, carries the update and
follows the drift the delay causes, while each late gradient enters with a small weight. Their
code runs it as torch's NAdam with ``β1 = 0.99`` on stashed weights (PluralisResearch/AsyncPP,
``run.bash``: ``--momentum 0.99``); their variant without a weight stash gives each stage a
momentum that grows with its delay, 0.9 at the last stage to 0.99 at the first.

This correction is that schedule of momenta, with four ways (``rise``) for stage ``i``, whose
forward delay is ``τ_i`` updates, to get from ``m``, the user's momentum (β1 of the Adam family,
SGD's and Muon's ``momentum``), to at most ``m_max``:

- ``"share"`` (Ajanthan et al.'s schedule): ``m_i = m + (m_max - m) τ_i / τ_max``, ``τ_max`` the
  longest delay of the pipeline. The most delayed stage gets ``m_max`` however short its delay:
  at N = 4 a stage under one update late goes from 0.9 to 0.99.
- ``"window"``: the momentum's averaging window, ``1/(1 - m)`` updates, grows by the delay:
  ``1/(1 - m_i) = 1/(1 - m) + τ_i``. A stage late by a fraction of an update keeps about its
  momentum; at τ = 15 Adam's 0.9 becomes 0.96.
- ``"stretch"``: the window is stretched by ``1 + τ_i``: ``1/(1 - m_i) = (1 + τ_i)/(1 - m)``;
  0.9 becomes 0.95 at τ = 1 and reaches 0.99 at τ = 9.
- ``"depth"``: Ajanthan et al.'s slope per update of delay, ``(m_max - m)/(P - 1)`` for P
  stages, as they set it on the fully asynchronous pipeline (N = 1, where stage ``i`` is
  ``P - 1 - i`` updates late): ``m_i = m + (m_max - m) τ_i/(P - 1)`` (the denominator never
  below the longest delay, so a lone delayed stage gets the share's rise, and for an averaged
  momentum never below :data:`DEPTH_SPAN`, 7: on fewer than 8 stages the slope of 8). At N = 1
  and P ≥ 8 it is ``"share"``; with N microbatches the delays, and so the rise, are about N
  times smaller; at P = 2 Adam's late stage gets 0.913, not the 0.99 that cost a GPT 14%.
  The default of :class:`~pipemare.optim.PipeMareConfig`, chosen by the fair protocol
  (docs/results.md): at N = 1 it keeps the share's gains, at N = 4 it no longer costs the
  quality the share's 0.99 did.

All four are capped at ``m_max`` and leave an undelayed stage at ``m``. For the Adam
family and Muon, whose momentum is an average, that is all. For SGD, whose momentum buffer is
a sum, the stage's rate is scaled by ``(1 - m_i)/(1 - m)``, so every gradient still moves the
weights by ``η/(1 - m)`` in total and only the way it is spread over the following updates
changes; that is the paper's ``(1 - γ)`` discount. The look-ahead itself comes from the
optimiser (NAdam, ``SGD(nesterov=True)``) or from weight prediction, which runs each forward at
the weights its update will meet along the optimiser's own step. No buffer.
"""

from __future__ import annotations

from pipemare.optim.corrections.base import (
    Correction,
    StageView,
    group_momentum,
    momentum_is_average,
)

__all__ = ["DEPTH_SPAN", "RISES", "DelayMomentum", "delay_momenta"]

#: The ways a stage's momentum may rise with its delay (see the module's docstring).
RISES = ("share", "window", "stretch", "depth")

#: ``"depth"``'s least denominator for an averaged momentum (the Adam family, Muon): the rise
#: takes at least this many updates of delay to reach the top, the slope across 8 stages at
#: N = 1 where it was measured to help. Issue 40's ablation measured the steeper slope of 2
#: stages (0.99 on the one late stage) at +14% for a GPT trained with Adam, and those momenta
#: at +6.4% even without any delay. A summed momentum (SGD) keeps the steeper slope: with its
#: rate scaled by ``(1 - m_i)/(1 - m)`` the raise damps, and a gentler one narrowed the
#: delayed quadratic's stable range below no correction's (tests/optim/test_guard.py)
DEPTH_SPAN = 7


def delay_momenta(
    user: float, top: float, delays: list[float], rise: str = "share", span: float = 0.0
) -> list[float]:
    """Each stage's momentum: ``user`` at no delay, rising with the delay by ``rise``, at most
    ``top`` (``"share"``: ``top`` at the longest delay, linear between); ``span``: ``"depth"``'s
    least denominator (:data:`DEPTH_SPAN` for an averaged momentum).

    Example:
        >>> delay_momenta(0.9, 0.99, [3.0, 1.5, 0.0])
        [0.99, 0.945, 0.9]
        >>> delay_momenta(0.9, 0.99, [15.0, 0.5, 0.0], rise="window")
        [0.96, 0.904761904762, 0.9]
        >>> delay_momenta(0.9, 0.99, [15.0, 1.0, 0.0], rise="stretch")
        [0.99, 0.95, 0.9]
        >>> delay_momenta(0.9, 0.99, [0.5, 0.25, 0.0], rise="depth")
        [0.9225, 0.91125, 0.9]
        >>> delay_momenta(0.9, 0.99, [1.0, 0.0], rise="depth", span=DEPTH_SPAN)  # Adam, P = 2
        [0.912857142857, 0.9]
    """
    if rise not in RISES:
        raise ValueError(f"delay_momentum_rise must be one of {RISES}, got {rise!r}")
    if rise in ("share", "depth"):
        longest = max(delays, default=0.0)
        # depth: the delays of P stages reach P - 1 at N = 1; never steeper than the share
        # (nor than 1/span)
        if rise == "depth":
            longest = max(longest, len(delays) - 1, span)
        if longest <= 0:
            return [user for _ in delays]
        return [round(user + (top - user) * min(d / longest, 1.0), 12) for d in delays]
    window = 1.0 / (1.0 - user)
    out = []
    for d in delays:
        grown = window + d if rise == "window" else window * (1.0 + d)
        out.append(round(max(user, min(top, 1.0 - 1.0 / grown)), 12))
    return out


class DelayMomentum(Correction):
    """Raises each stage's momentum with its delay (see the module's docstring).

    Args:
        top: the momentum of the stage with the longest delay (Ajanthan et al.: 0.99).
        start: the first step it applies to (T3's warm-up steps have no delay).
        rise: how the momentum follows the delay: ``"share"``, ``"window"``, ``"stretch"`` or
            ``"depth"`` (:data:`RISES`, the module's docstring).
    """

    name = "delay_momentum"
    derived_for = (
        "Nesterov/NAdam (Ajanthan et al.); a summed momentum (SGD) keeps each gradient's total"
        " step by a rate factor, an averaged one (Adam family, Muon) needs none; 'auto' stands"
        " aside without momentum and for Muon (measured better off)"
    )

    def __init__(self, top: float, start: int = 0, rise: str = "share") -> None:
        if not 0.0 <= top < 1.0:
            raise ValueError(f"delay_momentum must lie in [0, 1), got {top}")
        if rise not in RISES:
            raise ValueError(f"delay_momentum_rise must be one of {RISES}, got {rise!r}")
        self.top, self.start, self.rise = top, start, rise
        self.adam_family = True

    def bind(self, view: StageView) -> None:
        super().bind(view)
        # an averaged momentum (every group's) needs no rate factor; a summed one does
        groups = view.optimizer.param_groups
        self.adam_family = all(momentum_is_average(view.optimizer, g) for g in groups)

    def _delays(self) -> list[float]:
        return [d.forward for d in self.view.delays]

    def momentum(self, stage: int, step: int, momentum: float) -> float:
        if not self._applies(step):
            return momentum
        span = DEPTH_SPAN if self.adam_family else 0
        raised = delay_momenta(momentum, self.top, self._delays(), self.rise, span)[stage]
        return momentum + (raised - momentum) * self.view.stage_strength(stage)

    def lr_factor(self, stage: int, step: int) -> float:
        """For summed (SGD) momentum ``(1 - m_i)/(1 - m)``, keeping each gradient's total step
        ``η/(1 - m)``; 1 for an averaged momentum (the Adam family, Muon)."""
        if self.adam_family or not self._applies(step):
            return 1.0
        user = group_momentum(self.view.optimizer.param_groups[0])
        return (1.0 - self.momentum(stage, step, user)) / (1.0 - user)
