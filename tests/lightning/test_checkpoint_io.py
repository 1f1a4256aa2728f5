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

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts


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
        [sys.executable, str(SUPPORT / "slow_writer.py"), str(path)],
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


def test_ckpt_path_last_never_picks_what_a_killed_save_left(other_fs):
    """Where the filesystem lacks O_TMPFILE, a writer killed mid-save leaves a hidden
    ``.last.ckpt.pipemare-*.tmp`` (swept by the next save). ``fit(ckpt_path="last")``, which an
    automatic restart resumes with, resolves to the newest *complete* ``last*.ckpt`` all the
    same: Lightning's lookup (checked here as fit calls it) matches ``last`` names ending in
    ``.ckpt`` only, so a partial file is never loaded."""
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.states import TrainerFn

    atomic_save({"w": torch.zeros(10)}, other_fs / "last.ckpt")
    partial = other_fs / ".last.ckpt.pipemare-1234-5678.tmp"
    partial.write_bytes(b"PK\x03\x04 half a checkpoint")  # newer than last.ckpt
    os.utime(partial, (os.path.getmtime(other_fs / "last.ckpt") + 60,) * 2)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=other_fs, save_last=True)
    trainer = pl.Trainer(callbacks=[ckpt], logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.FITTING
    resolved = trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=False
    )
    assert resolved == str(other_fs / "last.ckpt")
    assert torch.equal(torch.load(resolved)["w"], torch.zeros(10))


def test_a_file_replaces_a_directory_of_shards_of_the_same_name(tmp_path):
    """A run that writes one file (one process, or save_distributed_checkpoint=False) where an
    earlier run wrote per-stage shards of the same name replaces them."""
    shards = tmp_path / "last.ckpt"
    shards.mkdir()
    (shards / "meta.pt").write_bytes(b"old")
    atomic_save({"w": torch.ones(1)}, shards)
    assert shards.is_file() and torch.load(shards)["w"].tolist() == [1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
