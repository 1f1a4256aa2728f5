"""pipemare: PipeMare-style asynchronous pipeline parallelism for PyTorch (Lightning)."""

from pipemare.delay import StageDelay, closed_form_delays, derive_delays
from pipemare.schedule import SCHEDULES, generate

__all__ = ["SCHEDULES", "StageDelay", "closed_form_delays", "derive_delays", "generate"]

__version__ = "0.1.0"
