"""The optimiser a stage steps: a wrapper around the user's optimiser, the staleness
corrections it applies (:mod:`~pipemare.optim.corrections`), their typed configuration, the
one place that resolves it for a run (:mod:`~pipemare.optim.settings`) and the
delayed-quadratic theory that bounds them (:mod:`~pipemare.optim.stability`).

Reads delays from :mod:`pipemare.schedule`; knows nothing of processes or Lightning.
"""

from pipemare.optim.chain import ChainedOptimizer
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.muon import MuonAdamW, muon_param_groups
from pipemare.optim.optimizer import PipeMareOptimizer
from pipemare.optim.rotated import RotatedAdamW, rotated_param_groups
from pipemare.optim.settings import RunSettings, resolve

__all__ = [
    "ChainedOptimizer",
    "MuonAdamW",
    "PipeMareConfig",
    "PipeMareOptimizer",
    "RotatedAdamW",
    "RunSettings",
    "muon_param_groups",
    "resolve",
    "rotated_param_groups",
]
