"""What the experiments' commands share: an argument parser that shows the module's docstring."""

from __future__ import annotations

import argparse


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser for ``prog`` whose ``--help`` shows ``doc`` with its line breaks kept."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
