"""The run summary's report of a pipeline's memory, stage by stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipemare import Pipeline
from pipemare.experiments.studies.summary import memory_report
from pipemare.optim import RotatedAdamW


def test_the_memory_report_shows_the_basis_per_stage():
    """The run summary's memory report (:func:`memory_report`) gives each stage's optimiser
    state with the rotated basis inside it: ``2(m² + n²)`` float32 numbers per matrix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = RotatedAdamW(model.parameters(), lr=1e-3)
    pipe = Pipeline(model, opt, nn.functional.cross_entropy, stages=2, microbatches=1)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for _ in range(3):
        pipe.step((x, y))
    pipe.drain()
    report = memory_report(SimpleNamespace(strategy=SimpleNamespace(pipeline=pipe)))["stages"]
    mb = 4 / 2**20
    sizes = [(16, 8), (4, 16)]
    for stage, (m, n) in zip(report, sizes, strict=True):
        assert stage["rotated_basis_mb"] == pytest.approx(2 * (m * m + n * n) * mb)
        adam = 2 * (m * n + m) * mb
        assert stage["optimizer_state_mb"] == pytest.approx(
            adam + stage["rotated_basis_mb"] + 2 * mb
        )
