"""Launching real processes from a test: a clean environment, every command started and waited
for (only its own processes are ever killed), a free port, and the JSON reports ranks write."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The folder that holds this package: on a launched worker's path, so that it imports it.
TESTS = Path(__file__).resolve().parents[1]


def environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))
    }
    path = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    env.update(extra)
    return env


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 900) -> None:
    """Start every command and wait for all; show the output of failures. Kills only its own."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in commands
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs, strict=False):
        assert p.returncode == 0, f"launch failed ({p.returncode}):\n{out[-6000:]}"


def run_here(main: Callable[[list[str]], None], *args: str) -> None:
    """Run a worker script's ``main(args)`` in this process: a one-device reference needs no
    process of its own (a launch costs seconds of imports). The worker sets one intra-op thread,
    as its launched processes have; this process's count is put back after."""
    threads = torch.get_num_threads()
    try:
        main(list(args))
    finally:
        torch.set_num_threads(threads)


def reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"report-rank{r}.json").read_text()) for r in range(world)]
