"""The delayed quadratic: where a correction's stable step range is measured.

Gradient descent with gradients ``τ`` updates old on ``f(u) = λu²/2`` is
``u_{t+1} = u_t - αλ u_{t-τ}``, stable iff ``αλ < 2 sin(π / (4τ + 2))`` (about ``π/(2τ+1)``).
With heavy-ball momentum β, ``u_{t+1} = u_t + β(u_t - u_{t-1}) - αλ u_{t-τ}`` is stable iff
every root of ``z^{τ+1} - (1+β) z^τ + β z^{τ-1} + αλ`` lies inside the unit circle
(:func:`delayed_momentum_bound`). The same recurrence, run through a real optimiser and a
correction, shows the range a correction makes stable (:func:`largest_stable_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipemare.schedule.delay import StageDelay

if TYPE_CHECKING:
    from pipemare.optim.config import PipeMareConfig

__all__ = [
    "delayed_gd_bound",
    "delayed_momentum_bound",
    "delayed_quadratic_progress",
    "is_stable",
    "largest_stable_step",
    "misaligned_curvature",
]


def delayed_gd_bound(delay: int) -> float:
    """Largest stable ``αλ`` of ``u_{t+1} = u_t - αλ u_{t-τ}`` (delay τ, curvature λ).

    Example:
        >>> round(delayed_gd_bound(0), 6), round(delayed_gd_bound(1), 6)
        (2.0, 1.0)
    """
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    return 2.0 * math.sin(math.pi / (4 * delay + 2))


def _contracts(step: float, delay: int, momentum: float) -> bool:
    """Whether every root of ``z^{τ+2} - (1+β) z^{τ+1} + β z^τ + αλ z`` (the characteristic
    polynomial times z, which holds τ = 0 too) lies strictly inside the unit circle."""
    import numpy as np

    coefficients = np.zeros(delay + 3)
    coefficients[0], coefficients[1], coefficients[2] = 1.0, -(1.0 + momentum), momentum
    coefficients[delay + 1] += step
    return bool(np.abs(np.roots(coefficients)).max() < 1.0)


def delayed_momentum_bound(delay: int, momentum: float, tol: float = 1e-9) -> float:
    """Largest stable ``αλ`` of delayed heavy-ball momentum, from the roots of its polynomial.

    ``u_{t+1} = u_t + β(u_t - u_{t-1}) - αλ u_{t-τ}`` (torch's ``SGD(momentum=β)`` with
    gradients τ updates late); at β = 0 it is :func:`delayed_gd_bound`, and at τ = 0 the
    classical ``2(1 + β)``.

    Example:
        >>> round(delayed_momentum_bound(0, 0.9), 6), round(delayed_momentum_bound(1, 0.0), 6)
        (3.8, 1.0)
    """
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
    low, high = 0.0, 2.0 * (1.0 + momentum)
    while high - low > tol:
        mid = (low + high) / 2
        if _contracts(mid, delay, momentum):
            low = mid
        else:
            high = mid
    return low


def misaligned_curvature(size: int, condition: float = 100.0, seed: int = 0) -> torch.Tensor:
    """``V diag(λ) Vᵀ``: eigenvalues log-spaced from 1 to ``condition``, eigenvectors a random
    rotation ``V`` (float64), so no stiff direction is a coordinate (the setting where basis
    rotation says Adam suffers from delay, arXiv 2602.03515)."""
    g = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    eigenvalues = torch.logspace(0, math.log10(condition), size, dtype=torch.float64)
    return rotation @ torch.diag(eigenvalues) @ rotation.T


def _delayed_trace(
    rate: float,
    delay: int,
    optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer],
    config: PipeMareConfig,
    steps: int,
    curvature: torch.Tensor | None = None,
) -> list[float]:
    """``|u|`` after each update on ``f(u) = u²/2`` with gradients ``delay`` updates late,
    the start first (cut short at a blow-up, which ends it with inf). With ``curvature`` ``S``
    (n × n), ``u`` is an n × n matrix from a seeded draw, ``f(u) = tr(u S uᵀ)/2``, its
    gradient ``u S``, and ``|u|`` is ``sqrt(2 f)``."""
    from pipemare.optim.optimizer import PipeMareOptimizer

    if curvature is None:
        u = nn.Parameter(torch.ones(1, dtype=torch.float64))
    else:
        start = torch.randn(curvature.shape, generator=torch.Generator().manual_seed(1))
        u = nn.Parameter(start.to(torch.float64))

    def gradient(w: torch.Tensor) -> torch.Tensor:
        return w.clone() if curvature is None else w @ curvature

    def size(w: torch.Tensor) -> float:
        if curvature is None:
            return abs(float(w))
        # tr(u S uᵀ) as the sum of (u S) ∘ u: a fifth of einsum's time at n = 8
        return math.sqrt(max(float((w @ curvature).mul_(w).sum()), 0.0))

    delays = (StageDelay(float(delay), 0.0, ((delay, 0),)),)
    opt = PipeMareOptimizer(optimizer([u], rate), {0: [u]}, delays, config, total_steps=steps)
    queue: list[torch.Tensor] = []
    trace = [size(u.detach())]
    applied = 0
    for t in range(steps):
        opt.record(t)
        # the forward of minibatch t, whose gradient becomes update t (now: version `applied`)
        with opt.forward_weights(0, t - applied):
            queue.append(gradient(u.detach()))
        if len(queue) > delay:
            g = queue.pop(0)  # accumulated as autograd does (a held update keeps .grad)
            u.grad = g if u.grad is None else u.grad + g
            opt.step(0, applied)
            applied += 1
        trace.append(size(u.detach()))
        if not math.isfinite(trace[-1]) or trace[-1] > 1e12:
            return [*trace[:-1], math.inf]
    return trace


def _delayed_quadratic(
    rate: float,
    delay: int,
    optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer],
    config: PipeMareConfig,
    steps: int,
    curvature: torch.Tensor | None = None,
) -> float:
    """Growth of ``|u|`` (:func:`_delayed_trace`): the last window's peak over the first
    window's (below 1: the iteration contracts)."""
    trace = _delayed_trace(rate, delay, optimizer, config, steps, curvature)
    if not math.isfinite(trace[-1]):
        return math.inf
    window = max((len(trace) - 1) // 8, 2 * delay + 2)
    return max(trace[-window:]) / max(max(trace[1 : window + 1]), 1e-300)


def delayed_quadratic_progress(
    rate: float,
    delay: int,
    optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer],
    config: PipeMareConfig | None = None,
    steps: int = 600,
    curvature: torch.Tensor | None = None,
) -> float:
    """How far ``steps`` delayed updates get: ``|u|`` at the end (its peak over the last
    eighth) over ``|u|`` at the start; inf where it blows up. For an optimiser whose step is
    normalised (the Adam family), which never blows up on a quadratic, this is what the delay
    costs: the rate range where it stays small is its useful range."""
    from pipemare.optim.config import PipeMareConfig

    cfg = config if config is not None else PipeMareConfig.off()
    trace = _delayed_trace(rate, delay, optimizer, cfg, steps, curvature)
    if not math.isfinite(trace[-1]):
        return math.inf
    return max(trace[-max(steps // 8, 1) :]) / max(trace[0], 1e-300)


def is_stable(
    rate: float,
    delay: int,
    config: PipeMareConfig | None = None,
    optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer] | None = None,
    steps: int = 600,
    curvature: torch.Tensor | None = None,
) -> bool:
    """Whether the delayed quadratic contracts at ``αλ = rate`` under ``config`` (the test
    :func:`largest_stable_step` bisects on, with the same arguments). One run where a
    comparison of two stable ranges needs only one side: the range of ``config`` reaches past
    ``x`` where it is stable at ``x``."""
    from pipemare.optim.config import PipeMareConfig

    cfg = config if config is not None else PipeMareConfig.off()
    make = optimizer or (lambda ps, lr: torch.optim.SGD(ps, lr=lr))
    return _delayed_quadratic(rate, delay, make, cfg, steps, curvature) < 1.0


def largest_stable_step(
    delay: int,
    config: PipeMareConfig | None = None,
    optimizer: Callable[[list[nn.Parameter], float], torch.optim.Optimizer] | None = None,
    steps: int = 600,
    high: float = 8.0,
    tol: float = 1e-3,
    curvature: torch.Tensor | None = None,
) -> float:
    """The largest ``αλ`` for which the delayed quadratic contracts, under ``config``.

    Runs ``u_{t+1} = u_t - α ∇f(u_{t-τ})`` on ``f(u) = λu²/2`` (λ = 1) through the real
    optimiser wrapper, the correction's hooks included, and bisects on α. Without
    corrections and with plain SGD it finds :func:`delayed_gd_bound`.

    Args:
        delay: τ.
        config: the corrections (default: none). T1's horizon is the whole run.
        optimizer: ``(params, lr) -> optimiser`` (default: plain SGD).
        curvature: ``S`` for a matrix weight on ``tr(u S uᵀ)/2`` (e.g.
            :func:`misaligned_curvature`); the bound of plain SGD there is
            ``2 sin(π/(4τ+2)) / λ_max``.
    """
    low, hi = 0.0, high
    while hi - low > tol:
        mid = (low + hi) / 2
        if is_stable(mid, delay, config, optimizer, steps, curvature):
            low = mid
        else:
            hi = mid
    return low
