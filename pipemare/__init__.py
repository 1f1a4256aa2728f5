"""pipemare: PipeMare-style asynchronous pipeline parallelism for PyTorch Lightning.

Importing it registers ``strategy="pipemare"`` (and ``pipemare_<schedule>``) with Lightning.
"""

from pipemare.config import PipeMareConfig
from pipemare.delay import StageDelay, closed_form_delays, derive_delays
from pipemare.errors import NonFiniteGradientError, NonFiniteLossError
from pipemare.optim import PipeMareOptimizer
from pipemare.pipeline import Pipeline
from pipemare.schedule import SCHEDULES, generate
from pipemare.strategy import LightningPipeMareStrategy, PipeMareStrategy, register
from pipemare.transport import DistributedTransport, InProcessTransport, Transport

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
