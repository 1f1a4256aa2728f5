"""A user's GPT through ``Trainer(strategy="pipemare", devices=2)`` with nothing else set,
against the same GPT on one device (issue 40).

The GPT (tests/support/gpt.py: four blocks in a ModuleList, the head tied to the token
embedding) learns Python's standard-library source byte by byte with AdamW at the rate tuned on
one device for this run. The default layout at P = 2 is N = 2 microbatches (every delay under
one update) and the even cut [3, 3].

The issue's runs were 384 steps: the one-device sweep gave 2.575 (1e-3), 2.535 (3e-3), 2.449
(1e-2) and 2.817 (3e-2), so 1e-2; (seed 0; seed 1) one device 2.449; 2.475, pipemare's default
2.530 (+3.3%); 2.504 (+1.2%), uncorrected async at the same layout 2.563 (+4.7%); 2.583
(+4.4%). At N = 1, the default before issue 40, the gap was +17% (the issue's report). The
issue's bar, within 2% of one device, is met on seed 1 and missed on seed 0 (and at 768 steps:
+3.9%).

This test runs 256 steps (issue 50: CI time), where 1e-2 is still one device's best (2.568 at
3e-3, 2.532 at 1e-2, 2.947 at 3e-2). Seeds 0, 1, 2: one device 2.532, 2.599, 2.618; pipemare
2.614 (+3.2%), 2.708 (+4.2%), 2.695 (+3.0%). It holds the measured level on seed 0, within 5%,
so that a change that loses it shows: at N = 1 again the run ends at 2.744 (+8.4%).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support import gpt_quality_worker
from support.launch import ranks, run_all, run_here

# one worker runs the module: its tests share a module-scoped launch
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("gpt_quality")]
WORKER = str(Path(__file__).resolve().parents[1] / "support" / "gpt_quality_worker.py")


#: both tests' runs, each trained in turn on one device and in one launch on two processes
RECIPES = ("constant", "nanogpt")
STEPS = 256


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both recipes on one device (the worker's run in this process) and in one launch on two
    processes (not a run per test and device count); each test reads its recipe's reports."""
    out = tmp_path_factory.mktemp("gpt-quality")
    args = ["--steps", str(STEPS), "--recipes", *RECIPES]
    (out / "one").mkdir()
    run_here(gpt_quality_worker.main, "--out", str(out / "one"), "--devices", "1", *args)
    (out / "two").mkdir()
    cmd = [sys.executable, WORKER, "--out", str(out / "two"), "--devices", "2", *args]
    run_all(ranks(cmd, 2))
    return out


def _reports(out: Path, recipe: str) -> tuple[dict, dict]:
    return tuple(  # type: ignore[return-value]
        json.loads((out / d / f"report-{recipe}.json").read_text()) for d in ("one", "two")
    )


def test_a_gpt_at_two_processes_with_nothing_set_trains_near_one_device(runs):
    one, two = _reports(runs, "constant")
    assert one["global_step"] == two["global_step"] == STEPS
    # N = P by default; balance='time' cuts the even [3, 3] (its timings would have to be off
    # by more than its tolerance to cut otherwise, and such a cut trains differently)
    assert (two["stages"], two["microbatches"], two["balance"]) == (2, 2, [3, 3])
    gap = two["val_loss"] / one["val_loss"] - 1
    print(
        f"\nval_loss: one device {one['val_loss']:.3f}, pipemare {two['val_loss']:.3f} ({gap:+.1%})"
    )
    assert gap < 0.05


def test_a_gpt_trained_with_warm_up_and_cosine_decay_at_two_processes_stays_near_one_device(
    runs,
):
    """The same GPT trained as nanoGPT trains one (AdamW 0.9/0.95, weight decay 0.1, linear
    warm-up over the first tenth, cosine decay to 0; a LambdaLR stepped every step), at the
    rate tuned on one device for it. In the issue's 384-step runs the sweep gave 2.507 (3e-3),
    2.423 (1e-2) and 2.442 (3e-2), so 1e-2, and with nothing else set, seeds 0, 1, 2: one
    device 2.423, 2.415, 2.454; pipemare 2.448 (+1.0%), 2.480 (+2.7%), 2.447 (-0.3%); mean
    +1.15%: the issue's bar, 1% of one device, is missed on the mean (docs/results.md). At this
    test's 256 steps 1e-2 is still best (2.621 at 3e-3, 2.543 at 1e-2, 2.623 at 3e-2); seeds 0,
    1, 2: one device 2.543, 2.570, 2.599; pipemare 2.544 (+0.0%), 2.639 (+2.7%), 2.622 (+0.9%).
    It holds the measured level on seed 0 within 2.5%, so that a change that loses it shows."""
    one, two = _reports(runs, "nanogpt")
    assert one["global_step"] == two["global_step"] == STEPS
    assert (two["stages"], two["microbatches"], two["balance"]) == (2, 2, [3, 3])
    gap = two["val_loss"] / one["val_loss"] - 1
    print(
        f"\nwarm-up + cosine: one device {one['val_loss']:.3f}, pipemare {two['val_loss']:.3f} "
        f"({gap:+.1%})"
    )
    assert gap < 0.025
