"""What the experiments' commands share: an argument parser that shows the module's docstring."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`(?:([^`<]*?)\s*<[^`>]*>|~?([^`]*))`")


def plain_text(doc: str) -> str:
    """``doc`` (a module's reStructuredText) as a terminal shows it: a role reduced to the name
    it points at (its last part where the target starts with a tilde), literals and bold to
    their text.

    Example:
        >>> role = ":" + "mod:`~pipemare.experiments.main_job`"  # a role, built so that the
        >>> plain_text("``pipemare study``: see " + role + ", **now**")  # docs do not link it
        'pipemare study: see main_job, now'
    """

    def role(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if text:
            return text
        return target.rsplit(".", 1)[-1] if match.group(0).find("`~") >= 0 else target

    doc = _ROLE.sub(role, doc)
    return doc.replace("``", "").replace("**", "")


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser for ``prog`` whose ``--help`` shows ``doc`` as plain text, its line breaks
    kept."""
    return argparse.ArgumentParser(
        prog=prog,
        description=None if doc is None else plain_text(doc),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_tasks_argument(
    parser: argparse.ArgumentParser, tasks: list[str], default: list[str]
) -> None:
    """``--tasks``: the usage line says TASK, the help lists the tasks."""
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=default,
        choices=tasks,
        metavar="TASK",
        help="tasks to run (default: %(default)s); one of: " + ", ".join(tasks),
    )
