"""What users of every pipeline library ask for, kept working on the tied GPT: evaluation before
any training (pytorch/pytorch#162822), and a checkpoint written at one pipeline degree resumed
at another (torchtitan#850), trained on before it is compared; in one process and on two."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl

from pipemare import PipeMareStrategy
from support.models import quiet_trainer
from support.real_modules import GPTModule, tokens
from support.real_runs import two_process_workflow, val_loss

#: steps before the checkpoint, and the step the resumed runs train on to
SAVED, RESUMED = 6, 12


def _checkpoint_at_p4(out: Path) -> Path:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out, save_last=True)
    strategy = PipeMareStrategy(stages=4, schedule="gpipe")
    t = quiet_trainer(strategy, max_steps=SAVED, enable_checkpointing=True, callbacks=[ckpt])
    t.fit(GPTModule(), tokens(n=256))
    return Path(ckpt.last_model_path)


def _resumed(ckpt: Path, strategy) -> float:
    model = GPTModule()
    t = quiet_trainer(strategy, max_steps=RESUMED)
    t.fit(model, tokens(n=256), ckpt_path=ckpt)
    assert t.global_step == RESUMED
    return val_loss(model, tokens())


def test_validate_before_any_fit_gives_one_devices_loss_then_fit_trains():
    model = GPTModule()
    want = val_loss(model, tokens())
    t = quiet_trainer(PipeMareStrategy(stages=2), max_steps=4)
    (got,) = t.validate(model, tokens(), verbose=False)
    assert got["val_loss"] == pytest.approx(want, rel=1e-5)
    t.fit(model, tokens())
    assert t.global_step == 4 and val_loss(model, tokens()) < want


def test_a_checkpoint_written_at_p4_resumes_at_p2_and_on_two_processes(tmp_path):
    """gpipe computes one device's steps at any P, so the run resumed at P = 2 (one process,
    and two) ends where the one resumed at P = 4 ends; the asynchronous default resumes at
    P = 2 too and trains on. Two processes also validate before their fit."""
    ckpt = _checkpoint_at_p4(tmp_path)
    at_4 = _resumed(ckpt, PipeMareStrategy(stages=4, schedule="gpipe"))
    at_2 = _resumed(ckpt, PipeMareStrategy(stages=2, schedule="gpipe"))
    assert at_2 == pytest.approx(at_4, rel=1e-4)  # the issue asked 0.1%
    fresh = val_loss(GPTModule(), tokens())
    default = _resumed(ckpt, PipeMareStrategy(stages=2))
    assert default < fresh
    args = ["--task", "gpt", "--strategy", "pipemare_gpipe", "--steps", str(RESUMED)]
    for report in two_process_workflow(tmp_path / "two", *args, "--ckpt", str(ckpt)):
        assert report["val_before_fit"] == pytest.approx(fresh, rel=1e-5)
        assert report["val_loss"] == pytest.approx(at_4, rel=1e-4)
        assert report["global_step"] == RESUMED and report["stages"] == 2
