"""T1, T2 and the stability bound as pure functions."""

from __future__ import annotations

import math

import pytest
import torch

from pipemare.optim import corrections
from pipemare.optim.stability import delayed_gd_bound


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0, 2.0, 3.5, 7.0])
@pytest.mark.parametrize("k", [0, 1, 10, 50, 99, 100, 150])
def test_lr_factor_matches_formula(tau, k):
    horizon = 100
    expected = max(tau, 1.0) ** -(1.0 - min(k / horizon, 1.0))
    assert corrections.lr_factor(tau, k, horizon) == pytest.approx(expected, rel=1e-12)


def test_lr_factor_starts_at_one_over_tau_and_reaches_one():
    assert corrections.lr_factor(8.0, 0, 40) == pytest.approx(1 / 8)
    assert corrections.lr_factor(8.0, 20, 40) == pytest.approx(1 / math.sqrt(8))
    assert corrections.lr_factor(8.0, 40, 40) == 1.0
    assert corrections.lr_factor(8.0, 5, 0) == 1.0  # no horizon: no rescheduling


def test_velocity_decay():
    assert corrections.velocity_decay(1.0, 0.1) == pytest.approx(0.1)
    assert corrections.velocity_decay(4.0, 0.1) == pytest.approx(0.1**0.25)
    assert corrections.velocity_decay(0.0, 0.1) == 0.0
    with pytest.raises(ValueError, match=r"lie in \[0, 1\)"):
        corrections.velocity_decay(1.0, 1.0)


def test_backward_weight_keeps_strides_and_values():
    w = torch.randn(5, 3).t()  # non-contiguous
    v = torch.randn(3, 5)
    out = corrections.backward_weight(w, v, 2.0)
    assert out.stride() == w.stride()
    torch.testing.assert_close(out, w - 2.0 * v)


def _delayed_gd_stable(a: float, tau: int, steps: int = 4000) -> bool:
    u = [1.0] * (tau + 1)
    for _ in range(steps):
        u.append(u[-1] - a * u[-1 - tau])
    return max(abs(x) for x in u[-200:]) < 1.0


@pytest.mark.parametrize("tau", [0, 1, 2, 4, 8])
def test_stability_bound_separates_stable_from_unstable(tau):
    bound = delayed_gd_bound(tau)
    assert _delayed_gd_stable(0.97 * bound, tau)
    assert not _delayed_gd_stable(1.03 * bound, tau)
    assert bound == pytest.approx(math.pi / (2 * tau + 1), rel=0.06 if tau else 0.6)
