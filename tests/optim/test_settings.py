"""The run's settings are resolved once, by one function, into one frozen description."""

from __future__ import annotations

import dataclasses
import json

import pytest
import resolution_table
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig
from pipemare.optim.settings import Decision, RunSettings, resolve
from pipemare.planner.decide import auto_microbatches
from pipemare.schedule.delay import derive_delays


def test_the_resolver_reproduces_every_decision_taken_before_it_existed():
    """Optimiser family x P x N x schedule x config x run length: the corrections in effect,
    each stage's rate factor and momentum, the minibatches held and the errors, as the code
    before the resolver took them (tests/optim/resolution_table.py). Changed on purpose since:
    the Adam family's delay-aware momenta at P = 2 and 4 (the depth rise's least span, issue 40;
    regenerated with ``python tests/optim/resolution_table.py``)."""
    saved = resolution_table.saved()
    now = json.loads(json.dumps(resolution_table.table()))
    assert len(saved) == len(now) > 7000
    differ = [key for key in saved if saved[key] != now.get(key)]
    assert differ == [], f"{len(differ)} cells changed, e.g. {differ[:3]}"


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2))]


def _decided(settings: RunSettings) -> dict[str, Decision]:
    return {d.subject: d for d in settings.decisions}


def test_every_auto_setting_is_a_decision_with_its_reason():
    plain = resolve(None, torch.optim.SGD(_params(), lr=0.1), stages=4, total_steps=1000)
    why = _decided(plain)
    assert str(why["corrections"]) == (
        "corrections: PipeMare's corrections (the default of schedule 'pipemare')"
    )
    assert why["weight_prediction"].choice == "off"
    assert "SGD without momentum" in why["weight_prediction"].reason
    assert why["delay_momentum"].choice == "off" and "no momentum" in why["delay_momentum"].reason
    assert why["local_accumulation"].choice == "on (c = 1)"
    assert why["lr_reschedule horizon"].choice == "130 steps"
    assert "0.13 of the run's 1000 steps" in why["lr_reschedule horizon"].reason
    adam = resolve(None, torch.optim.AdamW(_params()), stages=4, total_steps=1000)
    why = _decided(adam)
    assert why["weight_prediction"].choice == "on" and why["spike_compensation"].choice == "on"
    assert why["lr_reschedule horizon"].choice == "500 steps"  # the Adam family at N = 1
    assert why["local_accumulation"].choice == "off"
    # an asked-for setting is no decision of the library's
    asked = resolve(PipeMareConfig(weight_prediction=True), torch.optim.AdamW(_params()), stages=4)
    assert "weight_prediction" not in _decided(asked)
    assert "  lr_reschedule horizon: 500 steps (the run's length is not known)" in asked.lines()


def test_the_schedule_picks_the_default_and_a_stashing_one_refuses_prediction():
    adam = torch.optim.AdamW(_params())
    for schedule in ("gpipe", "1f1b", "pipedream", "async"):
        settings = resolve(None, adam, schedule=schedule, stages=4)
        assert settings.corrections == () and settings.config == PipeMareConfig.off()
        assert _decided(settings)["corrections"].choice == "none"
    stashed = resolve(PipeMareConfig(), adam, schedule="pipedream", stages=4)
    assert not stashed.predicts
    assert "stashes" in _decided(stashed)["weight_prediction"].reason
    with pytest.raises(ValueError, match="weight_prediction cannot run with 'pipedream'"):
        resolve(PipeMareConfig(weight_prediction=True), adam, schedule="pipedream", stages=4)


def test_the_settings_are_frozen_and_keep_a_copy_of_what_was_asked():
    config = PipeMareConfig(warmup_steps=5)
    settings = resolve(config, torch.optim.AdamW(_params()), stages=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.horizon = 3  # type: ignore[misc]
    config.warmup_steps = 50  # the user's object changes later: the run's settings do not
    assert settings.warmup_steps == 5 and settings.config.warmup_steps == 5


def test_a_new_run_length_gives_new_settings_through_one_method():
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    settings = resolve(None, sgd, stages=4, total_steps=1000)
    shorter = settings.for_run_length(400)
    assert (settings.horizon, shorter.horizon, shorter.total_steps) == (130, 52, 400)
    assert "lr_reschedule(horizon=52)" in shorter.describe()
    assert _decided(shorter)["lr_reschedule horizon"].choice == "52 steps"
    assert settings.horizon == 130  # the old settings stand as they were
    fixed = resolve(PipeMareConfig(reschedule_steps=70), sgd, stages=4, total_steps=1000)
    assert fixed.for_run_length(400) is fixed  # a horizon in steps does not follow the run


def test_a_pipeline_runs_with_its_settings_and_builds_its_corrections_from_them():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    pipe = Pipeline(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.functional.mse_loss,
        stages=3,
        total_steps=200,
    )
    settings = pipe.settings
    assert settings.layout() == "schedule 'pipemare', P=3, N=1, layers per stage [1, 1, 1]"
    assert [c.name for c in pipe.optimizer.corrections] == [c.name for c in settings.corrections]
    assert pipe.optimizer.describe() == settings.describe()
    assert pipe.optimizer.run_state()["resolved"]["decisions"] == [
        str(d) for d in settings.decisions
    ]
    # prediction is off for plain SGD: its forwards are not wrapped at all
    assert not settings.predicts


@pytest.mark.parametrize("schedule", ["pipemare", "async", "pipedream"])
@pytest.mark.parametrize("stages", [2, 3, 4, 8, 16])
def test_auto_microbatches_keep_every_delay_under_one_update(schedule, stages):
    n, decision = auto_microbatches(schedule, stages)
    delays = derive_delays(schedule, stages, n)
    assert all(d.forward < 1 for d in delays) and max(d.forward_max for d in delays) == 1
    # the smallest such N: one fewer leaves the first stage a whole update late on average
    assert n == 1 or derive_delays(schedule, stages, n - 1)[0].forward >= 1
    assert decision.subject == "microbatches" and decision.choice == f"N={n}"
    # a batch too small for N = P caps it, and says so
    capped, why = auto_microbatches(schedule, stages, rows=stages - 1)
    assert capped == stages - 1 and "smallest batch" in why.reason


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_auto_microbatches_leave_flushing_schedules_at_one(schedule):
    n, decision = auto_microbatches(schedule, 8, rows=64)
    assert n == 1 and "no delay to bound" in decision.reason


def test_delay_momentum_below_the_optimisers_own_warns_with_its_registered_line():
    """Set below the optimiser's momentum, delay-aware momentum would lower a delayed stage's
    momentum: the run goes on and says so, in the registry's words; at or above it, nothing."""
    import warnings

    from pipemare.lines import text

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning) as said:
        resolve(PipeMareConfig(delay_momentum=0.5), sgd, stages=4, total_steps=100)
    assert [str(w.message) for w in said] == [text("delay_momentum.below", given=0.5, own=0.9)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve(PipeMareConfig(delay_momentum=0.95), sgd, stages=4, total_steps=100)
