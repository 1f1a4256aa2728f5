"""The benchmarks' command-line plumbing: the model's options, handing options on, torchrun."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_model_options(
    parser: argparse.ArgumentParser, width: int | None, depth: int, batch: int
) -> None:
    """``--width``, ``--depth`` and ``--batch``: the benchmarked MLP and its minibatch."""
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--depth", type=int, default=depth)
    parser.add_argument("--batch", type=int, default=batch)


def flags(args: argparse.Namespace, *names: str) -> list[str]:
    """``--NAME VALUE`` for each of ``names`` (each item of a list value; ``_`` in a name
    written ``-``, as the option is spelt), to hand ``args`` on."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        out += [
            f"--{name.replace('_', '-')}",
            *(map(str, value) if isinstance(value, list) else [str(value)]),
        ]
    return out


def torchrun(
    module: str, processes: int, argv: list[str], timeout: float, failure: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m MODULE worker ARGV`` in ``processes`` one-thread processes under torchrun.

    Raises:
        RuntimeError: ``failure`` and the tail of the launch's stderr, if it fails.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        module,
        "worker",
        *argv,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{failure}:\n{proc.stderr[-4000:]}")
    return proc
