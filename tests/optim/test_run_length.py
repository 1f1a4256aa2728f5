"""A resume continues the same run: what T1's horizon was derived from the run's length is kept,
unless the config's own horizon settings changed, and either difference is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipemare import PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim.corrections import LRReschedule
from pipemare.optim.settings import RunSettings, resolve


def optimiser(config: PipeMareConfig, **run: int) -> PipeMareOptimizer:
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    stages = {0: list(model[0].parameters()), 1: list(model[1].parameters())}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    return PipeMareOptimizer(sgd, stages, derive_delays("pipemare", 2, 1), config, **run)


def horizon(opt: PipeMareOptimizer) -> int:
    return next(c for c in opt.corrections if isinstance(c, LRReschedule)).horizon


def test_the_engine_optimiser_keeps_the_saved_runs_horizon_and_names_the_difference():
    saved = optimiser(PipeMareConfig(), total_steps=1000).state_dict()
    assert saved["run"]["horizon"] == 130 and saved["run"]["total_steps"] == 1000
    longer = optimiser(PipeMareConfig(), total_steps=2000)
    assert horizon(longer) == 260
    (note,) = longer.load_state_dict(saved)
    assert horizon(longer) == 130
    assert "stays 130 steps" in note and "1000 steps" in note and "would give 260" in note
    # its own checkpoints store the horizon with what it came from: a second resume says so
    again = longer.state_dict()
    assert again["run"]["horizon"] == 130 and again["run"]["total_steps"] == 1000
    third = optimiser(PipeMareConfig(), total_steps=3000)
    (note,) = third.load_state_dict(again)
    assert horizon(third) == 130 and "of the run's 1000 steps" in note and "give 390" in note
    same = optimiser(PipeMareConfig(), total_steps=1000)
    assert same.load_state_dict(saved) == [] and horizon(same) == 130


@pytest.mark.parametrize(
    ("changed", "new", "said"),
    [
        ({"reschedule_steps": 50}, 50, "reschedule_steps from None to 50"),
        ({"reschedule_fraction": 0.2}, 200, "reschedule_fraction from 0.13 to 0.2"),
        ({"warmup_steps": 100}, 117, "warmup_steps from 0 to 100"),
    ],
)
def test_a_horizon_setting_the_user_changed_applies_and_is_named(changed, new, said):
    saved = optimiser(PipeMareConfig(), total_steps=1000).state_dict()
    opt = optimiser(PipeMareConfig(**changed), total_steps=1000)
    (note,) = opt.load_state_dict(saved)
    assert horizon(opt) == new
    assert f"changes from 130 steps (0.13 of the run's 1000 steps) to {new} steps" in note
    assert said in note


def test_a_horizon_in_epochs_is_kept_when_the_epochs_length_changes():
    config = PipeMareConfig(reschedule_epochs=2)
    saved = optimiser(config, total_steps=1000, steps_per_epoch=40).state_dict()
    opt = optimiser(config, total_steps=1000, steps_per_epoch=50)
    (note,) = opt.load_state_dict(saved)
    assert horizon(opt) == 80 and "2 epochs of 40 steps" in note and "would give 100" in note


def test_without_t1_now_or_then_there_is_nothing_to_keep():
    off = PipeMareConfig(lr_reschedule=False)
    saved = optimiser(off, total_steps=1000).state_dict()
    assert saved["run"]["horizon"] is None
    assert optimiser(PipeMareConfig(), total_steps=2000).load_state_dict(saved) == []
    on = optimiser(PipeMareConfig(), total_steps=1000).state_dict()
    assert optimiser(off, total_steps=2000).load_state_dict(on) == []
    old = {k: v for k, v in on.items() if k != "run"}  # a checkpoint from before it was stored
    assert optimiser(PipeMareConfig(), total_steps=2000).load_state_dict(old) == []


# -- "auto": half the run for the Adam family at N = 1, 0.13 otherwise ----------------------------


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))]


def _muon_adamw() -> torch.optim.Optimizer:
    from pipemare.optim import ChainedOptimizer

    matrix, bias = _params()
    return ChainedOptimizer([torch.optim.Muon([matrix]), torch.optim.AdamW([bias])])


def _adam_chain() -> torch.optim.Optimizer:
    from pipemare.optim import ChainedOptimizer

    matrix, bias = _params()
    return ChainedOptimizer([torch.optim.Adam([matrix]), torch.optim.AdamW([bias])])


def _muon_adamw_one() -> torch.optim.Optimizer:
    from pipemare.optim import MuonAdamW, muon_param_groups

    layer = nn.Linear(3, 3)
    return MuonAdamW(muon_param_groups(nn.Sequential(layer)), lr=0.01)


def _rotated() -> torch.optim.Optimizer:
    from pipemare.optim import RotatedAdamW

    return RotatedAdamW(_params())


@pytest.mark.parametrize(
    ("build", "fraction"),
    [
        (lambda: torch.optim.Adam(_params()), 0.5),
        (lambda: torch.optim.AdamW(_params()), 0.5),
        (lambda: torch.optim.NAdam(_params()), 0.5),
        (_rotated, 0.5),
        (_adam_chain, 0.5),
        (lambda: torch.optim.SGD(_params(), lr=0.1), 0.13),
        (lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9), 0.13),
        (lambda: torch.optim.Muon([_params()[0]]), 0.13),
        (_muon_adamw, 0.13),
        (_muon_adamw_one, 0.13),
    ],
    ids=["adam", "adamw", "nadam", "rotated", "adam+adamw", "sgd", "sgdm", "muon", "chain", "mix"],
)
def test_auto_relaxes_t1_over_half_the_run_only_where_every_group_is_adam(build, fraction):
    optimizer = build()

    def settings(config: PipeMareConfig, n: int = 1) -> RunSettings:
        return resolve(config, optimizer, stages=2, microbatches=n, total_steps=1000)

    assert settings(PipeMareConfig()).fraction == fraction
    assert settings(PipeMareConfig()).horizon == 1000 * fraction
    (why,) = [d for d in settings(PipeMareConfig()).decisions if "horizon" in d.subject]
    assert why.choice == f"{1000 * fraction:g} steps" and f"{fraction:g} of the run's" in why.reason
    assert settings(PipeMareConfig(), n=4).fraction == 0.13  # short delays: 13%
    assert settings(PipeMareConfig(reschedule_fraction=0.2)).fraction == 0.2  # a number rules


def test_the_engine_optimiser_reads_its_optimiser_for_t1s_horizon():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    stages = {0: list(model[0].parameters()), 1: list(model[1].parameters())}
    delays = derive_delays("pipemare", 2, 1)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = PipeMareOptimizer(adam, stages, delays, PipeMareConfig(), total_steps=1000)
    assert horizon(opt) == 500 and opt.state_dict()["run"]["settings"]["reschedule_fraction"] == 0.5
    assert "lr_reschedule(horizon=500)" in opt.describe()
    warm = PipeMareConfig(warmup_steps=100)
    assert horizon(PipeMareOptimizer(adam, stages, delays, warm, total_steps=1100)) == 500
    four = derive_delays("pipemare", 2, 4)
    opt = PipeMareOptimizer(adam, stages, four, PipeMareConfig(), microbatches=4, total_steps=1000)
    assert (
        horizon(opt) == 130 and opt.state_dict()["run"]["settings"]["reschedule_fraction"] == 0.13
    )


def test_a_checkpoint_from_the_old_default_resumes_with_adams_horizon_and_says_so():
    """Before "auto" every run stored 0.13; an Adam run resumed now takes half the run, named."""
    saved = optimiser(PipeMareConfig(), total_steps=1000).state_dict()  # SGD: 0.13, as before
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    stages = {0: list(model[0].parameters()), 1: list(model[1].parameters())}
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = PipeMareOptimizer(
        adam, stages, derive_delays("pipemare", 2, 1), PipeMareConfig(), total_steps=1000
    )
    saved["optimizer"] = opt.optimizer.state_dict()
    (note,) = opt.load_state_dict(saved)
    assert horizon(opt) == 500
    assert "changes from 130 steps (0.13 of the run's 1000 steps) to 500 steps" in note
    assert "reschedule_fraction from 0.13 to 0.5" in note
