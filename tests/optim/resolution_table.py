"""The resolved corrections of every optimiser family x P x N x schedule x config, as a table.

What a run does with its corrections, read through the optimiser wrapper's public methods: the
corrections in effect as the run's log names them, each stage's factor on the rate and its
momentum at a few steps, which minibatches a stage holds, and the error a combination is
refused with. The table in data/ was written by the code before the settings were gathered into
one resolver (each cell through a Pipeline's optimiser); tests/optim/test_settings.py checks that
the resolver reproduces every cell, so gathering the decisions changed none of them.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipemare import PipeMareConfig
from pipemare.optim import ChainedOptimizer, MuonAdamW, PipeMareOptimizer, RotatedAdamW
from pipemare.optim.settings import resolve

TABLE = pathlib.Path(__file__).parent / "data" / "resolved_corrections.json.gz"
STAGES = (1, 2, 4, 8)
MICROBATCHES = (1, 4)
SCHEDULES = ("gpipe", "1f1b", "pipedream", "async", "pipemare")


def saved() -> dict[str, Any]:
    """The table as written before the refactor."""
    return json.loads(gzip.decompress(TABLE.read_bytes()))


def _params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def _muon_adamw(model: nn.Module) -> torch.optim.Optimizer:
    weights = [m.weight for m in model]
    biases = [m.bias for m in model]
    groups = [{"params": weights, "use_muon": True}, {"params": biases, "use_muon": False}]
    return MuonAdamW(groups, lr=0.01)


def _torch_muon(model: nn.Module) -> torch.optim.Optimizer:
    muon = torch.optim.Muon([m.weight for m in model], lr=0.01)
    return ChainedOptimizer([muon, torch.optim.AdamW([m.bias for m in model], lr=0.01)])


def _sgd_and_adamw(model: nn.Module) -> torch.optim.Optimizer:
    sgd = torch.optim.SGD([m.weight for m in model], lr=0.01, momentum=0.9)
    return ChainedOptimizer([sgd, torch.optim.AdamW([m.bias for m in model], lr=0.01)])


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(_params(m), lr=0.01),
    "sgdm": lambda m: torch.optim.SGD(_params(m), lr=0.01, momentum=0.9),
    "nesterov": lambda m: torch.optim.SGD(_params(m), lr=0.01, momentum=0.9, nesterov=True),
    "adam": lambda m: torch.optim.Adam(_params(m), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(_params(m), lr=0.01),
    "nadam": lambda m: torch.optim.NAdam(_params(m), lr=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(_params(m), lr=0.01),
    "rotated": lambda m: RotatedAdamW(_params(m), lr=0.01),
    "muon_adamw": _muon_adamw,
    "torch_muon": _torch_muon,
    "sgd_adamw": _sgd_and_adamw,
}

CONFIGS: dict[str, Callable[[], PipeMareConfig | None]] = {
    "default": lambda: None,
    "PipeMareConfig()": PipeMareConfig,
    "off": PipeMareConfig.off,
    "t1_t2": PipeMareConfig.t1_t2,
    "warmup=10": lambda: PipeMareConfig(warmup_steps=10),
    "epochs=2": lambda: PipeMareConfig(reschedule_epochs=2),
    "fraction=0.3": lambda: PipeMareConfig(reschedule_fraction=0.3),
    "accumulation=2": lambda: PipeMareConfig(local_accumulation=2),
    "error_feedback=1": lambda: PipeMareConfig(error_feedback=1.0),
    "error_feedback=delay": lambda: PipeMareConfig(error_feedback="delay"),
    "prediction=True": lambda: PipeMareConfig(weight_prediction=True),
    "spike=True": lambda: PipeMareConfig(spike_compensation=True),
    "momentum=0.95": lambda: PipeMareConfig(delay_momentum=0.95, delay_momentum_rise="share"),
    "T2": lambda: PipeMareConfig(discrepancy_correction=True),
}

#: The run lengths told: none, and 1,000 steps of 50 per epoch.
LENGTHS = {"unknown": {}, "1000": {"total_steps": 1000, "steps_per_epoch": 50}}


def fingerprint(opt: PipeMareOptimizer, stages: int) -> dict[str, Any]:
    """What the run does with its corrections, per stage, read through public methods."""
    every = range(stages)
    return {
        "described": opt.describe(),
        "lr_factor": {str(s): [round(opt.lr_factor(i, s), 9) for i in every] for s in (0, 20, 400)},
        "momentum": {str(s): [round(opt.momentum(i, s), 9) for i in every] for s in (0, 20)},
        "holds": [[any(c.holds(i, m) for c in opt.corrections) for m in range(4)] for i in every],
        "warmup": opt.settings.warmup_steps,
    }


def resolve_one(
    optimizer: str, stages: int, n: int, schedule: str, config: str, length: str
) -> dict[str, Any] | str:
    """One cell: the fingerprint of the optimiser a Pipeline builds for it (its settings
    resolved as the Pipeline resolves them), or the error it is refused with."""
    # torch.manual_seed(0) on the CPU generator alone: the whole call also seeds every lazy
    # accelerator, recording a stack each time (5 s over the table's 7,040 cells)
    torch.default_generator.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(stages)))
    opt = OPTIMIZERS[optimizer](model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            settings = resolve(
                CONFIGS[config](),
                opt,
                schedule=schedule,
                stages=stages,
                microbatches=n,
                **LENGTHS[length],
            )
            wrapper = PipeMareOptimizer(
                opt,
                {i: list(model[i].parameters()) for i in range(stages)},
                settings.delays,
                microbatches=n,
                settings=settings,
            )
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return fingerprint(wrapper, stages)


def keys() -> list[tuple[str, int, int, str, str, str]]:
    """Every cell: the default config at both run lengths, the others at 1,000 steps."""
    out = []
    for optimizer in OPTIMIZERS:
        for stages in STAGES:
            for n in MICROBATCHES:
                for schedule in SCHEDULES:
                    for config in CONFIGS:
                        lengths = LENGTHS if config in ("default", "epochs=2") else ("1000",)
                        for length in lengths:
                            out.append((optimizer, stages, n, schedule, config, length))
    return out


def table() -> dict[str, Any]:
    """Every cell's fingerprint (or the error it is refused with)."""
    return {"|".join(map(str, key)): resolve_one(*key) for key in keys()}


if __name__ == "__main__":
    TABLE.write_bytes(gzip.compress(json.dumps(table(), sort_keys=True).encode(), mtime=0))
    print(f"wrote {TABLE}")
