"""Callbacks that watch an asynchronous pipeline train: staleness, convergence, utilisation,
memory.

They log through Lightning's logger interface (any logger works) and add Weights & Biases
extras when a ``WandbLogger`` is present.
"""

from pipemare.callbacks.budget import PipelineTimeBudget
from pipemare.callbacks.convergence import ConvergenceMonitor, Divergence, DivergenceError
from pipemare.callbacks.memory import MemoryMonitor
from pipemare.callbacks.pipeline import PipelineMonitor, chrome_trace
from pipemare.callbacks.staleness import StalenessMonitor
from pipemare.callbacks.wandb import OfflineSafeWandbLogger, wandb_logger

__all__ = [
    "ConvergenceMonitor",
    "Divergence",
    "DivergenceError",
    "MemoryMonitor",
    "OfflineSafeWandbLogger",
    "PipelineMonitor",
    "PipelineTimeBudget",
    "StalenessMonitor",
    "chrome_trace",
    "monitors",
    "wandb_logger",
]


def monitors(trace_path: str | None = None, target: tuple[str, float, str] | None = None) -> list:
    """pipemare's three monitors with their default settings."""
    return [
        StalenessMonitor(),
        ConvergenceMonitor(target=target),
        PipelineMonitor(trace_path=trace_path),
    ]
