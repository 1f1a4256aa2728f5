"""Shared fixtures: fixed seeds, offline W&B, process groups torn down after every test."""

from __future__ import annotations

import collections
import compileall
import json
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


def _unit(item: pytest.Item) -> str:
    """What one worker runs as a whole (``--dist loadgroup``): the test's xdist group, whose
    tests share module-scoped fixtures, else the test alone."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return "@" + str(mark.args[0] if mark.args else mark.kwargs.get("name"))
    return item.nodeid


def _longest_first(items: list[pytest.Item]) -> None:
    """Order the tests by their unit's measured seconds (tests/durations.json), the longest
    first. pytest-xdist hands the units out in this order (``--no-loadscope-reorder``), so the
    long ones start early and the short ones fill in at the end, where one worker would
    otherwise idle while the other finishes a long one. Within a unit, and for tests the file
    does not know (0 s), the collection's order stays."""
    path = Path(__file__).with_name("durations.json")
    seconds = json.loads(path.read_text()) if path.exists() else {}
    per_unit: dict[str, float] = collections.defaultdict(float)
    for item in items:
        per_unit[_unit(item)] += seconds.get(item.nodeid.split("@")[0], 0.0)  # xdist: "@group"
    first = {}  # each unit's first place in the collection, to keep a unit's tests together
    for i, item in enumerate(items):
        first.setdefault(_unit(item), i)
    items.sort(key=lambda item: (-per_unit[_unit(item)], first[_unit(item)]))


@pytest.hookimpl(trylast=True)  # after -m has deselected: only the tests that run count
def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; the CPU path is tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
