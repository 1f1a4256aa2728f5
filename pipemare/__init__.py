"""pipemare: PipeMare-style asynchronous pipeline parallelism for PyTorch Lightning.

Importing it registers ``strategy="pipemare"`` (and ``pipemare_<schedule>``) with Lightning.
"""

from pipemare.engine.errors import NonFiniteGradientError, NonFiniteLossError
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.transport import DistributedTransport, InProcessTransport, Transport
from pipemare.lightning.strategy import LightningPipeMareStrategy, PipeMareStrategy, register
from pipemare.optim import PipeMareConfig, PipeMareOptimizer
from pipemare.schedule import SCHEDULES, StageDelay, closed_form_delays, derive_delays, generate

register()

__all__ = [
    "SCHEDULES",
    "DistributedTransport",
    "InProcessTransport",
    "LightningPipeMareStrategy",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "PipeMareConfig",
    "PipeMareOptimizer",
    "PipeMareStrategy",
    "Pipeline",
    "StageDelay",
    "Transport",
    "closed_form_delays",
    "derive_delays",
    "generate",
]

__version__ = "0.1.0"
