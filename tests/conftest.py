"""Shared fixtures: fixed seeds, offline W&B, process groups torn down after every test."""

from __future__ import annotations

import os
import random

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; the CPU path is tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
