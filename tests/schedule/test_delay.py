"""Delays derived from the executed schedule against the documented closed form."""

from __future__ import annotations

import pytest

from pipemare import SCHEDULES, closed_form_delays, derive_delays


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 5, 8])
def test_derived_equals_closed_form(name, stages, micro):
    assert derive_delays(name, stages, micro) == closed_form_delays(name, stages, micro)


def test_known_values():
    d = derive_delays("pipemare", 4, 2)
    assert [x.per_microbatch for x in d] == [
        ((2, 0), (1, 0)),
        ((1, 0), (1, 0)),
        ((1, 0), (0, 0)),
        ((0, 0), (0, 0)),
    ]
    assert [x.forward for x in d] == [1.5, 1.0, 0.5, 0.0]
    assert [x.forward_max for x in d] == [2, 1, 1, 0]
    assert all(x.backward == 0 for x in d)


@pytest.mark.parametrize("stages", [2, 5, 9])
@pytest.mark.parametrize("micro", [1, 3, 4])
def test_mean_forward_delay_is_s_over_n(stages, micro):
    for i, d in enumerate(derive_delays("async", stages, micro)):
        assert d.forward == pytest.approx((stages - 1 - i) / micro)
        assert d.discrepancy == d.forward


def test_pipedream_backward_uses_forward_version():
    for d in derive_delays("pipedream", 5, 2):
        assert d.backward == d.forward and d.discrepancy == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flushing_schedules_have_no_delay(name):
    assert all(d.forward == d.backward == 0 for d in derive_delays(name, 6, 3))
