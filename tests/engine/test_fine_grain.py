"""Fine-grained asynchrony on a network without skip connections: one layer per stage, N = 1.

A plain 10-layer ReLU network on the digits (tests/support/models.py's plain_mlp), ten
stages, one minibatch in flight per stage: the longest delays the engine makes (9 updates at the
first stage) on the architecture that tolerates them worst. For each optimiser family, at a rate
where uncorrected ``async`` trains, the default corrections train too and end at least as well
on the mean over three seeds.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipemare import NonFiniteGradientError, NonFiniteLossError, Pipeline
from pipemare.optim import MuonAdamW, muon_param_groups
from support.data import digits
from support.models import plain_mlp

#: updates per run (600 until the suite's time budget: at 300, seed 0, gpipe 0.923, async 0.580
#: and the default 0.813 with SGD momentum; for the other optimisers the default leads async by
#: 0.05 (Muon) to 0.45 (Nesterov), where the bound asks for -0.02)
STEPS = 300

OPTIMIZERS = {
    "sgd": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr),
    "sgd-momentum": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
    "nesterov": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, nesterov=True),
    "adamw": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01),
    "muon-adamw": lambda m, lr: MuonAdamW(muon_param_groups(m), lr=lr, weight_decay=0.01),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """The runs compare schedules at equal thread counts (and one thread is 3× faster here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def accuracy(optimizer: str, lr: float, schedule: str, seed: int = 0) -> float:
    """Validation accuracy after ``STEPS`` steps; NaN if training stopped on a non-finite value."""
    torch.manual_seed(seed)
    model = plain_mlp(64, 10, layers=10)
    x, y, xv, yv = digits()
    pipe = Pipeline(
        model,
        OPTIMIZERS[optimizer](model, lr),
        nn.functional.cross_entropy,
        stages=10,
        microbatches=1,
        schedule=schedule,
        seed=seed,
        total_steps=STEPS,
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        try:
            loss = pipe.step((x[idx], y[idx]))
        except (NonFiniteLossError, NonFiniteGradientError):
            return math.nan
        if loss is not None and not math.isfinite(float(loss)):
            return math.nan
    with torch.no_grad():
        return float((model(xv).argmax(-1) == yv).float().mean())


def test_one_layer_per_stage_sgd_momentum_trains_with_the_default_where_async_does():
    """SGD with heavy-ball momentum 0.9 at a rate where gpipe and uncorrected asynchrony train
    a plain 10-layer network: the default corrections train it as well (finite, at least
    async's accuracy)."""
    lr = 1e-3
    sync, plain, default = (accuracy("sgd-momentum", lr, s) for s in ("gpipe", "async", "pipemare"))
    assert sync > 0.9 and plain > 0.5  # both train (chance: 0.1)
    assert math.isfinite(default) and default >= plain


#: optimiser -> a rate at which async trains the network (from a sweep of 3 rates each). Adam
#: is not here: AdamW at its rate runs the same corrections and, 3e-6 of decay per update
#: apart, the same run (at 200 updates async 0.737 and 0.730, the default 0.803 and 0.810), so
#: it repeated AdamW's check; AdamW's decoupled decay also takes spike compensation's decay path.
RATES = {
    "sgd": 1e-2,
    "nesterov": 3e-3,
    "adamw": 3e-4,
    "muon-adamw": 1e-3,
}


#: seeds each comparison averages over. Nine delays deep, one seed's ending moves with the
#: floating-point rounding of the CPU's kernels: with SGD at seed 0 the default led async on
#: one machine and trailed it by 0.057 on an AVX-512 one (0.623 against 0.680), where seeds 1
#: and 2 gave +0.037 and +0.283 (mean +0.088; Nesterov +0.41 to +0.54, AdamW +0.07 to +0.30,
#: Muon +0.01 to +0.04 on the same machine)
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("optimizer", RATES)
def test_the_default_is_never_worse_than_no_correction_on_any_optimiser(optimizer):
    """Over three seeds, the default's mean accuracy is at least async's mean, less 0.02."""
    plain = [accuracy(optimizer, RATES[optimizer], "async", seed) for seed in SEEDS]
    default = [accuracy(optimizer, RATES[optimizer], "pipemare", seed) for seed in SEEDS]
    assert all(map(math.isfinite, default)), default
    mean_plain, mean_default = sum(plain) / len(SEEDS), sum(default) / len(SEEDS)
    assert mean_plain > 0.3, plain  # async trains at this rate
    assert mean_default >= mean_plain - 0.02, (default, plain)
