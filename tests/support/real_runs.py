"""Comparing a run through the strategy with one device's: the held-out loss, the weights (up
to what rounding makes of a gradient that is zero in exact arithmetic), and a two-process run
of support/real_model_worker.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from support.launch import ranks, run_all
from support.models import quiet_trainer
from support.real_modules import SETUPS

WORKER = Path(__file__).resolve().parent / "real_model_worker.py"
WORKFLOWS = Path(__file__).resolve().parent / "workflow_worker.py"


def comparable(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` with the GPT's key bias zeroed. Its gradient is zero in exact arithmetic (a
    bias on the keys adds the same ``q·b`` to every score of a row, which softmax ignores), so
    what it gets is rounding noise; AdamW's normalisation turns that noise into steps of the
    size of the rate, which differ with the order of the sums (2e-3 after 20 steps, where every
    other weight agrees to 1e-5)."""
    if name.endswith("attn.c_attn.bias"):
        value = value.clone()
        third = value.numel() // 3
        value[third : 2 * third] = 0
    return value


def val_loss(module: pl.LightningModule, data: DataLoader) -> float:
    (out,) = quiet_trainer("auto").validate(module, data, verbose=False)
    return out["val_loss"]


def launch_two_processes(models: list[str], out: Path, *options: str) -> None:
    """One launch of support/real_model_worker.py on two gloo processes training each of
    ``models`` in turn through gpipe, a stage each, into ``out/MODEL``; ``options``: the
    worker's others (``--stages-from DIR``)."""
    cmd = [sys.executable, str(WORKER), "--out", str(out), *options, "--models", *models]
    run_all(ranks(cmd, 2))


def two_processes_equal_one_device(model: str, out: Path, weights: bool) -> None:
    """``SETUPS[model]`` trained by two gloo processes (:func:`launch_two_processes` into
    ``out``, unless a shared launch already did), a stage each, through gpipe, ends as on one
    device: every rank's validation loss and step count (and, with ``weights``, every rank's
    whole model), and the checkpoint rank 0 wrote, loaded into the plain module."""
    if not (out / model / "report-0.json").exists():
        launch_two_processes([model], out)
    out = out / model
    build, data, _, steps = SETUPS[model]
    plain = build()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: the ResNet turns last bits into 0.1s
    try:
        reference = quiet_trainer("auto", max_steps=steps)
        reference.fit(plain, data())
    finally:
        torch.set_num_threads(threads)
    want = val_loss(plain, data())
    for rank in (0, 1):
        if weights:
            got = torch.load(out / f"weights-{rank}.pt")
            for name, value in plain.state_dict().items():
                mine, want_w = comparable(name, got[name]), comparable(name, value)
                torch.testing.assert_close(mine, want_w, rtol=1e-4, atol=1e-4, msg=name)
        report = json.loads((out / f"report-{rank}.json").read_text())
        assert report["val_loss"] == pytest.approx(want, rel=1e-4)
        assert report["global_step"] == reference.global_step
    loaded = type(plain).load_from_checkpoint(out / "model.ckpt")
    assert val_loss(loaded, data()) == pytest.approx(want, rel=1e-4)


def two_process_workflow(out: Path, *args: str) -> list[dict]:
    """support/workflow_worker.py with ``args`` on two gloo processes; each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKFLOWS), "--out", str(out), *args]
    run_all(ranks(cmd, 2))
    return workflow_reports(out)


def workflow_reports(out: Path) -> list[dict]:
    """The two ranks' reports a workflow run wrote into ``out``."""
    return [json.loads((out / f"report-{rank}.json").read_text()) for rank in (0, 1)]
