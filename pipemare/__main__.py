"""The ``pipemare`` command line: Lightning's CLI for configs, studies, the dashboard, a demo."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable

_COMMANDS = {
    "fit": "train from a config (LightningCLI): pipemare fit --config configs/mnist.yaml",
    "validate": "validate from a config",
    "test": "test from a config",
    "predict": "predict from a config",
    "study": "run a named suite of configs: pipemare study default --out runs",
    "compare": "write the dashboard comparing runs: pipemare compare runs/default",
    "protocol": "the fair comparison: best LR per schedule, seeds, pipeline time (engine runs)",
    "user-protocol": "the user's protocol: the one-device rate for all, P = 2, 4, 8, against 1F1B",
    "bench": "throughput and memory against one process and torch's pipelines: pipemare bench",
    "demo": "train a small model on real data through 8 simulated stages (the engine alone)",
    "plan": "choose stages, replicas, microbatches and the cut: pipemare plan --config CONFIG",
    "consolidate": "per-stage shards into one checkpoint file: pipemare consolidate DIR OUT.ckpt",
}


def _version() -> str:
    """pipemare's version and those of what it runs on."""
    import lightning_fabric
    import torch

    from pipemare import __version__

    return (
        f"pipemare {__version__} (torch {torch.__version__}, Lightning "
        f"{lightning_fabric.__version__}, Python {sys.version.split()[0]})"
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(_version())
        raise SystemExit(0)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: pipemare [--version] COMMAND [options]\n\ncommands:")
        for name, text in _COMMANDS.items():
            print(f"  {name:<13} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            close = difflib.get_close_matches(argv[0], _COMMANDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            print(f"\nunknown command {argv[0]!r}{hint}", file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    from pipemare.cli.console import quiet

    quiet()  # the known chatter of Lightning and W&B (see the module)
    try:
        if command in ("fit", "validate", "test", "predict"):
            from pipemare.cli import lightning_cli

            lightning_cli.run_cli([command, *rest])
        elif command == "consolidate":
            from pipemare.cli import consolidate

            consolidate.run_consolidate(rest)
        else:  # the experiments' commands
            _experiment(command)(rest)
    except ModuleNotFoundError as err:
        _exit_if_extra_missing(err)
        raise


#: The packages of the ``experiments`` extra, which the core install leaves out.
_EXPERIMENTS_EXTRA = ("sklearn", "matplotlib", "mlxtend")

#: The module of each experiments' command, imported only when that command runs.
_EXPERIMENTS = {
    "study": "pipemare.experiments.studies.study",
    "protocol": "pipemare.experiments.studies.fair",
    "user-protocol": "pipemare.experiments.studies.user_protocol",
    "bench": "pipemare.experiments.bench.command",
    "plan": "pipemare.experiments.plan_command",
    "compare": "pipemare.experiments.dashboard.page",
    "demo": "pipemare.experiments.demo",
}


def _experiment(command: str) -> Callable[[list[str]], object]:
    """The ``main`` of an experiments' command."""
    return importlib.import_module(_EXPERIMENTS[command]).main


def _exit_if_extra_missing(err: ModuleNotFoundError) -> None:
    """A package of the experiments' extra is missing: say how to install it and exit 2."""
    missing = (err.name or "").split(".")[0]
    if missing in _EXPERIMENTS_EXTRA:
        print(
            f"error: this command needs {missing}, which the core install leaves out; "
            "install the experiments' extra: pip install 'pipemare[experiments]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
