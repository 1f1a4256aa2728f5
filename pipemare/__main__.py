"""The ``pipemare`` command line: Lightning's CLI for configs, studies, the dashboard, a demo."""

from __future__ import annotations

import difflib
import sys

_COMMANDS = {
    "fit": "train from a config (LightningCLI): pipemare fit --config configs/mnist.yaml",
    "validate": "validate from a config",
    "test": "test from a config",
    "predict": "predict from a config",
    "study": "run a named suite of configs: pipemare study default --out runs",
    "compare": "write the dashboard comparing runs: pipemare compare runs/default",
    "protocol": "the fair comparison: best LR per schedule, seeds, pipeline time (engine runs)",
    "bench": "throughput and memory against one process and torch's pipelines: pipemare bench",
    "demo": "train a small model on real data through 8 simulated stages (the engine alone)",
    "plan": "choose stages, replicas, microbatches and the cut: pipemare plan --config CONFIG",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: pipemare COMMAND [options]\n\ncommands:")
        for name, text in _COMMANDS.items():
            print(f"  {name:<9} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            close = difflib.get_close_matches(argv[0], _COMMANDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            print(f"\nunknown command {argv[0]!r}{hint}", file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    from pipemare.experiments.console import quiet

    quiet()  # the known chatter of Lightning and W&B (see the module)
    if command in ("fit", "validate", "test", "predict"):
        from pipemare.experiments import cli

        cli.main([command, *rest])
    elif command == "study":
        from pipemare.experiments.studies import study

        study.main(rest)
    elif command == "protocol":
        from pipemare.experiments.studies import fair

        fair.main(rest)
    elif command == "bench":
        from pipemare.experiments.bench import command as bench

        bench.main(rest)
    elif command == "plan":
        from pipemare.experiments import plan_command

        plan_command.main(rest)
    elif command == "compare":
        from pipemare.experiments.dashboard import page as dashboard

        dashboard.main(rest)
    else:
        from pipemare.experiments import demo

        demo.main(rest)


if __name__ == "__main__":
    main()
