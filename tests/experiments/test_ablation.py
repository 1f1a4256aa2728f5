"""The P = 2 ablation's variants: each runs the corrections, optimiser and rate it names."""

from __future__ import annotations

import math

import pytest
import torch

from pipemare.experiments.studies import ablation
from pipemare.experiments.studies.grid import VARIANTS
from pipemare.experiments.studies.protocol import TASKS
from pipemare.optim.settings import resolve


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("pipemare-noWP", ["lr_reschedule", "delay_momentum", "spike_compensation", "guard"]),
        ("pipemare-noSC", ["lr_reschedule", "delay_momentum", "weight_prediction", "guard"]),
        ("pipemare-noT1", ["delay_momentum", "spike_compensation", "weight_prediction", "guard"]),
        ("pipemare-DMalone", ["delay_momentum"]),
        ("pipemare-guard", ["guard"]),
    ],
)
def test_the_ablations_variants_run_what_they_name_at_p2(variant, expected):
    schedule, config = VARIANTS[variant]
    adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    settings = resolve(config, adamw, schedule=schedule, stages=2, total_steps=100)
    named = ["stability_guard" if e == "guard" else e for e in expected]
    assert [c.name for c in settings.corrections] == named


def test_the_extra_variants_swap_the_optimiser_and_scale_the_delayed_stages_rate():
    model = torch.nn.Linear(2, 2)
    nadam = ablation._swapped_optimizer(ablation.EXTRA["async+nadam99"], "adamw", model, 1e-3)
    assert type(nadam) is torch.optim.NAdam
    assert nadam.param_groups[0]["betas"][0] == 0.99
    assert nadam.param_groups[0]["decoupled_weight_decay"]
    adam = ablation._swapped_optimizer(ablation.EXTRA["gpipe+adam99"], "adam", model, 1e-3)
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["betas"][0] == 0.99
    with pytest.raises(ValueError, match="swaps Adam or AdamW"):
        ablation._swapped_optimizer(ablation.EXTRA["gpipe+adam99"], "sgdm", model, 1e-3)

    from pipemare.experiments.studies import protocol

    task = TASKS["plain@adamw"]
    with ablation._extended(ablation.EXTRA["async+rate"]):
        pipe = protocol._pipeline(task, task.build(), "async", 2, 1, 1e-3, None, 0)
    assert [pipe.optimizer.lr_factor(s, 5) for s in (0, 1)] == [0.5, 1.0]  # τ = 1, 0
    with ablation._extended(ablation.EXTRA["gpipe+first99"]):
        pipe = protocol._pipeline(task, task.build(), "gpipe", 2, 1, 1e-3, None, 0)
    assert [pipe.optimizer.momentum(s, 5) for s in (0, 1)] == [0.99, 0.9]  # without delay
    assert protocol._pipeline.__name__ == "_pipeline"  # put back


def test_an_extra_run_is_stored_and_tabulated(tmp_path):
    job = ablation.Job("plain@adamw", "async+rate", 2, 1, 1e-3, 0, 3)
    ablation.run([job], tmp_path, workers=1)
    rows = ablation.summarise(tmp_path, [job])
    assert rows[0]["steps_run"] == 3 and math.isfinite(rows[0]["final"])
    assert rows[0]["extra"]["delay_rate"] is True
    text = ablation.table_markdown(rows, ["plain@adamw"], [(2, 1)], ["async+rate"])
    assert "| async+rate |" in text and "P:N 2:1" in text
