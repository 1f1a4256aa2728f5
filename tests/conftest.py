"""Shared fixtures: fixed seeds, offline W&B, process groups torn down after every test."""

from __future__ import annotations

import compileall
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# Under pytest-xdist (the suite runs on two workers: pyproject's addopts) each worker keeps to
# one intra-op thread, as every launched rank does, so that two workers share two cores
# instead of four threads fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """Run with one intra-op thread, as each launched rank does, so results match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """Compile the project's own modules once, before the workers start. The suite starts
    over a hundred Python processes; where the environment says not to write bytecode
    (PYTHONDONTWRITEBYTECODE, as on this project's machines and CI's) each of them compiled
    every module of the project it imports again, about 0.2 s of CPU a process."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return  # a worker (the controller compiled), or imports write bytecode themselves
    root = Path(__file__).resolve().parents[1]
    for part in ("pipemare", "experiments", "tests"):
        compileall.compile_dir(root / part, quiet=1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; the CPU path is tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
