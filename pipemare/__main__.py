"""The ``pipemare`` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "train a small model on real data through 8 simulated stages"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: pipemare COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<8} {text}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "demo":
        from pipemare.experiments import demo

        demo.main(argv[1:])


if __name__ == "__main__":
    main()
