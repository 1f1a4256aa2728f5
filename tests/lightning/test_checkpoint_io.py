"""Checkpoint writes are atomic on another filesystem than /tmp and leave no temporary file."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pipemare import PipeMareStrategy
from pipemare.lightning.checkpoint_io import atomic_save

TESTS = Path(__file__).resolve().parents[1]  # the workers live beside conftest.py


@pytest.fixture
def other_fs():
    """A directory on /dev/shm (tmpfs: another filesystem than the temporary directory)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=root) as d:
        yield Path(d)


class Boom:
    def __reduce__(self):
        raise RuntimeError("interrupted mid-write")


def test_an_error_mid_write_keeps_the_old_checkpoint_and_no_temp_file(other_fs):
    path = other_fs / "last.ckpt"
    atomic_save({"w": torch.full((1000,), 1.0)}, path)
    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_save({"w": torch.full((100_000,), 2.0), "then": Boom()}, path)
    assert os.listdir(other_fs) == ["last.ckpt"]
    assert torch.equal(torch.load(path)["w"], torch.full((1000,), 1.0))


def test_a_writer_killed_mid_write_keeps_the_old_checkpoint_and_no_temp_file(other_fs):
    path = other_fs / "last.ckpt"
    atomic_save({"w": torch.zeros(10)}, path)
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "_slow_writer.py"), str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()  # only the process this test started
        proc.wait(timeout=60)
    leftovers = sorted(os.listdir(other_fs))
    assert torch.equal(torch.load(path)["w"], torch.zeros(10))
    # O_TMPFILE (tmpfs has it): the unfinished file never had a name; the next save sweeps
    # any named leftover of a filesystem without it
    atomic_save({"w": torch.ones(10)}, path)
    assert os.listdir(other_fs) == ["last.ckpt"], leftovers
    assert leftovers == ["last.ckpt"]


def test_the_strategy_saves_through_it_by_default(other_fs):
    strategy = PipeMareStrategy(stages=2)
    assert type(strategy.checkpoint_io).__name__ == "AtomicCheckpointIO"
    strategy.checkpoint_io.save_checkpoint(
        {"state_dict": {"a": torch.ones(2)}}, other_fs / "x.ckpt"
    )
    assert os.listdir(other_fs) == ["x.ckpt"]
    assert torch.equal(
        strategy.checkpoint_io.load_checkpoint(other_fs / "x.ckpt")["state_dict"]["a"],
        torch.ones(2),
    )
