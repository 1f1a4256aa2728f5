"""``pipemare fit|validate|test|predict --config ...``: Lightning's own CLI, with pipemare's parts.

Any LightningModule and LightningDataModule can be named by class path in a YAML config (or
on the command line), the strategy is ``pipemare.PipeMareStrategy`` with any schedule and
options, and every field can be overridden, e.g.
``pipemare fit --config configs/mnist.yaml --trainer.strategy.init_args.schedule=async``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# Lightning's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates: warnings a user can
# do nothing about (Lightning's to fix), so they stay off unless asked for.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

from pytorch_lightning.cli import LightningCLI

import pipemare  # noqa: F401 - registers the strategy names

__all__ = ["PipeMareCLI", "main"]


class PipeMareCLI(LightningCLI):
    """LightningCLI in subclass mode for model and data; re-running in a directory overwrites
    its saved config instead of refusing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # models take optimizer callables
        kwargs.setdefault("parser_kwargs", {"default_env": False})
        super().__init__(*args, **kwargs)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:  # a class refused its arguments; jsonargparse buries why
            if not str(err).startswith(_UNION_ERROR):
                raise
            print(f"error: the config could not be built: {_reasons(str(err))}", file=sys.stderr)
            raise SystemExit(2) from err


_UNION_ERROR = "Does not validate against any of the Union subtypes"
_NOISE = (_UNION_ERROR, "Subtypes:", "Errors:", "Expected a <class", "Given value", "Problem with")


def _reasons(report: str) -> str:
    """The classes' own error messages in jsonargparse's report of a failed instantiation."""
    lines = (line.strip().removeprefix("- ") for line in report.splitlines())
    reasons = [line for line in lines if line and not line.startswith(_NOISE)]
    return "; ".join(reasons) or report


def main(argv: list[str] | None = None) -> PipeMareCLI:
    return PipeMareCLI(args=argv)
