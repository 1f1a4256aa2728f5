"""``pipemare fit|validate|test|predict --config ...``: Lightning's own CLI, with pipemare's parts.

Any LightningModule and LightningDataModule can be named by class path in a YAML config (or
on the command line), the strategy is ``pipemare.PipeMareStrategy`` with any schedule and
options, and every field can be overridden, e.g.
``pipemare fit --config configs/mnist.yaml --trainer.strategy.init_args.schedule=async``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

# Lightning's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates: warnings a user can
# do nothing about (Lightning's to fix), so they stay off unless asked for.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

from jsonargparse import Namespace
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

import pipemare  # noqa: F401 - registers the strategy names

__all__ = ["DEFAULT_LOGGERS", "PipeMareCLI", "run_cli"]

_CSV = "pytorch_lightning.loggers.CSVLogger"
_WANDB = "pipemare.callbacks.OfflineSafeWandbLogger"

#: the loggers of a config that names none: CSV and W&B (offline without an API key), in runs/
DEFAULT_LOGGERS = [
    {"class_path": _CSV, "init_args": {"save_dir": "runs"}},
    {"class_path": _WANDB, "init_args": {"project": "pipemare", "save_dir": "runs"}},
]


class PipeMareCLI(LightningCLI):
    """LightningCLI in subclass mode for model and data, logging to CSV and W&B unless told
    otherwise; re-running in a directory overwrites its saved config instead of refusing.

    Beyond Lightning's own options: ``--no-wandb`` drops every W&B logger of the config (CSV
    stays, or is added). A W&B run without a group takes the config file's name, and one
    without a name its layout, e.g. ``pipemare-P8-N1``; Lightning's model summary is off (the
    strategy prints the stages instead; ``--trainer.enable_model_summary=true`` brings it back).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # models take optimizer callables
        kwargs.setdefault("parser_kwargs", {"default_env": False})
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--no-wandb``, and the defaults of a config that names no logger or summary."""
        parser.add_argument(
            "--no-wandb", action="store_true", help="log to CSV only: drop the config's W&B loggers"
        )
        parser.set_defaults(
            {"trainer.logger": DEFAULT_LOGGERS, "trainer.enable_model_summary": False}
        )

    def before_instantiate_classes(self) -> None:
        """Apply ``--no-wandb``, name and group the W&B runs, quiet evaluation's checkpoint
        callback (see the class)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand in ("validate", "test", "predict"):
            # a ModelCheckpoint restored outside fit warns that the new logger version moved
            # its directory: moot, nothing is checkpointed there
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
        loggers = _loggers(config.trainer.logger)
        if loggers is None:
            return
        if config.get("no_wandb"):
            kept = [log for log in loggers if not _is_wandb(log)]
            if not any(log.class_path == _CSV for log in kept):
                save_dir = next((_save_dir(log) for log in loggers if _save_dir(log)), "runs")
                kept.append(Namespace(class_path=_CSV, init_args=Namespace(save_dir=save_dir)))
            loggers = kept
        for log in loggers:
            if _is_wandb(log):
                args = log.init_args
                if args.get("group") is None and config.get("config"):
                    args.group = Path(str(config.config[0])).stem
                if args.get("name") is None:
                    args.name = _layout_name(config.trainer.get("strategy"))
        config.trainer.logger = loggers

    def instantiate_classes(self) -> None:
        """Lightning's, with a class's own refusal shown instead of jsonargparse's report."""
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


def _loggers(value: Any) -> list[Any] | None:
    """The config's logger entries as a list of class-path namespaces; None when it names
    something else (``false``, Lightning's default, an object)."""
    entries = value if isinstance(value, list) else [value]
    if not entries or not all(isinstance(e, Namespace) and "class_path" in e for e in entries):
        return None
    return list(entries)


def _is_wandb(logger: Namespace) -> bool:
    return logger.class_path.rsplit(".", 1)[-1] in ("WandbLogger", "OfflineSafeWandbLogger")


def _save_dir(logger: Namespace) -> str | None:
    args = logger.get("init_args")
    return None if args is None else args.get("save_dir")


def _layout_name(strategy: Any) -> str | None:
    """``{schedule}-P{stages}-N{microbatches}`` of a PipeMareStrategy config, else None."""
    if not isinstance(strategy, Namespace) or "PipeMare" not in str(strategy.get("class_path")):
        return None
    args = strategy.get("init_args") or Namespace()
    stages = args.get("stages")
    n = args.get("microbatches", "auto")
    return f"{args.get('schedule', 'pipemare')}-P{stages or 'auto'}-N{n}"


def run_cli(argv: list[str] | None = None) -> PipeMareCLI:
    """Run the CLI on ``argv`` (default: the command line)."""
    if argv is not None and argv == sys.argv[1:]:
        # the command line itself: LightningCLI reads it (given both, it warns), and the
        # processes a multi-process run launches re-run it
        argv = None
    return PipeMareCLI(args=argv)
