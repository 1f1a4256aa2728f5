"""Checkpoints leave the run alone, and a resume continues as documented.

Documented semantics (docs/checkpoints.md, "Checkpoints and resuming, exactly"): saving never
drains the pipeline, so a run that checkpoints every k steps computes exactly what a run that
never checkpoints does; the checkpoint of step t holds what every stage would hold had the
pipeline been drained after step t; resuming from it continues exactly as that drained run,
mid-epoch included (with a resumable DataLoader). Checked in one process (simulated stages)
and with a real SIGKILL of one of two processes, then a resume on two processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from pipemare.engine.lagged import snapshot_lag
from pipemare.schedule.actions import SCHEDULES, Op
from support import resume_worker as worker
from support.launch import environment, free_port, ranks, run, run_all

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts
WORKER = str(SUPPORT / "resume_worker.py")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _launch(out: Path, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """A run that ends well starts every rank itself; one where a rank kills itself is started
    by Lightning's launcher, which ends the other ranks when one dies."""
    cmd = [sys.executable, WORKER, "--out", str(out), *args]
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
    if expect_ok and devices > 1:
        run_all(ranks(cmd, devices), timeout=400)
        return subprocess.CompletedProcess(cmd, 0)
    proc = run(cmd, environment(), timeout=400)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-4000:]
    return proc


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_stage_has_applied_a_snapshots_update_within_the_lag(schedule):
    """The step by which a checkpoint is complete everywhere, checked on the streams
    themselves from a start (filling) and across T3's switch, not only in steady state."""
    from pipemare.engine.lagged import _done_by_step_end

    for stages in (1, 2, 3, 5):
        for n in (1, 2, 3):
            lag = snapshot_lag(schedule, stages, n)
            for warmup in (0, 3):
                for t in range(stages + 5):
                    for stage in range(stages):
                        done = _done_by_step_end(
                            schedule, stages, n, stage, (t + lag + 1) * n, Op.UPDATE, warmup
                        )
                        assert t in done, (stages, n, warmup, t, stage)
            if lag:  # and not a step sooner: stage 0 in steady state
                t = stages + 2
                early = _done_by_step_end(schedule, stages, n, 0, (t + lag) * n, Op.UPDATE)
                assert t not in early


def test_checkpointing_every_k_steps_changes_nothing_and_each_file_is_the_drained_state(tmp_path):
    never = worker.run(tmp_path / "never")
    every = worker.run(tmp_path / "every", every=4)
    a, b = _weights(tmp_path / "never" / "final.pt"), _weights(tmp_path / "every" / "final.pt")
    assert _max_diff(a, b) == 0.0  # bit for bit
    names = sorted(p.name for p in (tmp_path / "every" / "ckpt").glob("step=*.ckpt"))
    assert names == sorted(f"step={k}.ckpt" for k in range(4, 31, 4))
    assert never.global_step == every.global_step == 30
    # the checkpoint of step 12 holds what the run drained after step 12 held then (weights,
    # BatchNorm statistics, momentum), and it is mid-epoch (8 steps per epoch)
    worker.run(tmp_path / "twelve", drain_at=12)
    drained = torch.load(tmp_path / "twelve" / "drained.pt", weights_only=False)
    ckpt = torch.load(tmp_path / "every" / "ckpt" / "step=12.ckpt", weights_only=False)
    assert ckpt["global_step"] == 12
    assert _max_diff(ckpt["state_dict"], drained["state_dict"]) < 1e-6
    assert "net.1.running_mean" in ckpt["state_dict"]
    momentum = {k: v["momentum_buffer"] for k, v in ckpt["optimizer_states"][0]["state"].items()}
    live = drained["optimizer"]["state"]
    assert momentum.keys() == live.keys()
    for k, v in momentum.items():
        torch.testing.assert_close(v, live[k]["momentum_buffer"], rtol=0, atol=1e-6)
    assert ckpt["optimizer_states"][0]["pipemare"]["pipeline"]["minibatches"] == 12


def _resumed_equals_drained(tmp_path: Path, devices: int, stages: int) -> None:
    """Kill at step 17 (the checkpoint of step 15 is whole by then: lag 2 or 1), resume,
    finish at 30: equal to the run drained after step 15, data order included."""
    extra = ["--devices", str(devices), "--stages", str(stages)]
    killed = _launch(
        tmp_path / "killed", *extra, "--every", "5", "--kill-at", "17", "--kill-rank",
        str(devices - 1), expect_ok=False,
    )  # fmt: skip
    assert killed.returncode != 0
    ckpt_dir = tmp_path / "killed" / "ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "last.ckpt",
        "step=10.ckpt",
        "step=15.ckpt",
        "step=5.ckpt",
    ]  # fmt: skip; and no temporary file
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == 15  # mid-epoch: 8 steps per epoch
    _launch(tmp_path / "resumed", *extra, "--resume", str(ckpt_dir / "last.ckpt"))
    # the reference: uninterrupted, drained after step 15, in one process
    worker.run(tmp_path / "drained", stages=stages, drain_at=15)
    worker.run(tmp_path / "plain", stages=stages)
    resumed = _weights(tmp_path / "resumed" / "final.pt")
    diff = _max_diff(resumed, _weights(tmp_path / "drained" / "final.pt"))
    refill = _max_diff(resumed, _weights(tmp_path / "plain" / "final.pt"))
    print(f"\nresumed vs drained at the checkpoint: {diff:.2e}; vs never interrupted: {refill:.2e}")
    assert diff < 1e-6
    assert refill > 1e-5  # the refill is a real (documented) difference, not nothing
    seen = json.loads((tmp_path / "resumed" / "seen.json").read_text())
    ref = json.loads((tmp_path / "drained" / "seen.json").read_text())
    assert seen["first"] == 15 and seen["seen"] == ref["seen"][15:]


def test_killed_and_resumed_mid_epoch_equals_the_run_drained_at_the_checkpoint(tmp_path):
    _resumed_equals_drained(tmp_path, devices=1, stages=4)


@pytest.mark.distributed
def test_two_processes_rank_killed_resumed_equals_the_drained_run(tmp_path):
    _resumed_equals_drained(tmp_path, devices=2, stages=2)


def _torchrun_with_restarts(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The worker on 2 processes under torchrun with one restart allowed.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch's default (the agent's store shared with the
    workers, kept across restarts) leaves the first attempt's addresses in the store, and the
    restarted processes' gloo setup then fails about half the time connecting to the dead ones
    (measured on torch 2.13; pytorch/pytorch#135712). Unshared, each attempt has its own store.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        WORKER, "--out", str(out), "--devices", "2", "--stages", "2", *args,
    ]  # fmt: skip
    env = environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return run(cmd, env, timeout=400)  # torchrun and its workers forked: no fresh imports


@pytest.mark.distributed
def test_torchrun_restarts_a_killed_stage_and_resumes_from_the_last_checkpoint(tmp_path):
    """``fit(ckpt_path="last")`` under ``torchrun --max-restarts=1``: the first attempt finds no
    checkpoint and starts afresh; stage 1 is SIGKILLed two steps after the checkpoint of step 5
    is on disk; the agent restarts both processes, which resume from it and finish with exit
    0 and the weights of the uninterrupted run drained after step 5."""
    out = tmp_path / "job"
    proc = _torchrun_with_restarts(
        out, "--every", "5", "--kill-after-save", "2", "--kill-rank", "1", "--resume", "last"
    )
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]
    # the agent restarted the job (it logs only the earliest failure, which may be rank 0's
    # exit after it saw stage 1 gone: the attempt records below say what happened)
    assert "exitcode" in log
    first = json.loads((out / "attempt-0.json").read_text())
    second = json.loads((out / "attempt-1.json").read_text())
    assert first == {"global_step": 0, "ckpt_path": None}  # "last" with nothing there yet
    assert second == {"global_step": 5, "ckpt_path": str(out / "ckpt" / "last.ckpt")}
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == sorted(["last.ckpt", *(f"step={k}.ckpt" for k in range(5, 31, 5))])
    worker.run(tmp_path / "drained", stages=2, drain_at=5)  # the reference, in one process
    diff = _max_diff(_weights(out / "final.pt"), _weights(tmp_path / "drained" / "final.pt"))
    print(f"\nrestarted by torchrun vs drained at the checkpoint: {diff:.2e}")
    assert diff < 1e-6
    seen = json.loads((out / "seen.json").read_text())
    ref = json.loads((tmp_path / "drained" / "seen.json").read_text())
    assert seen["first"] == 5 and seen["seen"] == ref["seen"][5:]  # mid-epoch: the same data


@pytest.mark.distributed
def test_two_processes_checkpointing_changes_nothing(tmp_path):
    _launch(tmp_path / "every", "--devices", "2", "--every", "3")
    worker.run(tmp_path / "never", stages=2)
    every, never = tmp_path / "every", tmp_path / "never"
    assert _max_diff(_weights(every / "final.pt"), _weights(never / "final.pt")) < 1e-6
    assert len(list((every / "ckpt").glob("step=*.ckpt"))) == 10


def _saved(tmp_path: Path, max_steps: int = 6, **strategy: object) -> Path:
    from test_strategy import Tiny, tiny_data, trainer

    import pipemare

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    pl.seed_everything(0)
    t = trainer(
        pipemare.PipeMareStrategy(**strategy), max_steps=max_steps, enable_checkpointing=True,
        callbacks=[ckpt],
    )  # fmt: skip
    t.fit(Tiny(), tiny_data())
    return Path(ckpt.last_model_path)


def _resume(
    path: Path,
    max_steps: int = 8,
    about: str = "a checkpoint saved with another layout",
    **strategy: object,
) -> tuple[pl.Trainer, list[str]]:
    """Resume ``path``; returns the trainer and pipemare's resume warnings ``about`` that."""
    import warnings

    from test_strategy import Tiny, tiny_data, trainer

    import pipemare

    t = trainer(pipemare.PipeMareStrategy(**strategy), max_steps=max_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Tiny(), tiny_data(), ckpt_path=path)
    return t, [str(w.message) for w in caught if f"pipemare: resuming {about}" in str(w.message)]


def test_a_resume_with_an_automatic_balance_cuts_as_the_checkpointed_run(tmp_path):
    path = _saved(tmp_path, stages=4, microbatches=2, balance=[2, 1, 1, 1])
    t, notes = _resume(path, stages=4, microbatches=2, balance="time")
    assert t.strategy.balance == [2, 1, 1, 1] and not notes
    assert t.global_step == 8


def test_a_resume_with_automatic_microbatches_runs_the_checkpointed_runs_n(tmp_path):
    """1F1B's ``"auto"`` N is the fastest replayed step, a timing: a resume of the same
    schedule and P runs the checkpoint's N instead, whatever the timing would pick now, says
    so, and has no layout change to warn about."""
    path = _saved(tmp_path, stages=2, schedule="1f1b", microbatches=3, balance=[3, 2])
    t, notes = _resume(path, stages=2, schedule="1f1b", balance=[3, 2])
    assert t.strategy.microbatches == 3 and not notes and t.global_step == 8
    said = {d.subject: d.reason for d in t.strategy.settings.decisions}
    assert (
        said["microbatches"]
        == "as the checkpointed run chose it, so that the resumed run trains as it did"
    )


def test_a_resume_into_another_layout_says_what_carries_over_and_what_is_reset(tmp_path):
    path = _saved(tmp_path, stages=4, microbatches=2, balance=[2, 1, 1, 1])
    t, notes = _resume(path, stages=3, microbatches=4, balance=[2, 2, 1], schedule="async")
    assert t.global_step == 8 and len(notes) == 1
    note = notes[0]
    assert "weights, the optimiser's state and the step count carry over" in note
    assert "random streams are reset" in note and "4 stages [2, 1, 1, 1]" in note
    assert "the buffers of stability_guard and weight_prediction are dropped" in note
    assert "schedule changes from 'pipemare' to 'async'" in note
    assert "microbatches changes from 2 to 4" in note


def _horizon(trainer: pl.Trainer) -> Any:
    """The run's T1 correction (its ``horizon``, its ``lr_factor``)."""
    from pipemare.optim.corrections import LRReschedule

    pipe = trainer.strategy.pipeline
    return next(c for c in pipe.optimizer.corrections if isinstance(c, LRReschedule))


def test_a_resume_with_another_max_steps_keeps_the_checkpointed_runs_horizon(tmp_path):
    """T1's horizon is 0.13 of the run's steps: 4 of 30. Resumed at step 2 with max_steps=60
    (which alone would give 8) the run keeps 4, and a warning names both."""
    import warnings

    from pipemare.optim.corrections import lr_factor

    worker.run(tmp_path / "first", steps=30, every=2)  # 4 stages, N=2
    path = tmp_path / "first" / "ckpt" / "step=2.ckpt"
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["pipemare"]
    assert saved["optimizer"]["run"]["horizon"] == 4
    assert saved["optimizer"]["run"]["total_steps"] == 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = worker.run(tmp_path / "resumed", steps=60, resume=path)
    assert t.global_step == 60 and _horizon(t).horizon == 4
    # stage 0's rate factor at step 3, inside the horizon: the kept horizon's, not the new one's
    delay = t.strategy.pipeline.delays[0].forward
    assert delay == 1.5
    assert _horizon(t).lr_factor(0, 3) == lr_factor(delay, 3, 4) != lr_factor(delay, 3, 8)
    notes = [str(w.message) for w in caught if "continues the checkpointed run" in str(w.message)]
    assert len(notes) == 1, notes
    note = notes[0]
    assert "T1's horizon stays 4 steps" in note and "(0.13 of the run's 30 steps)" in note
    assert "(0.13 of the run's 60 steps) would give 8" in note
    assert "reschedule_steps=8" in note  # how to change it instead
    # what the resumed run's own checkpoints store, so a second resume keeps it too
    run = t.strategy.pipeline.optimizer.run_state()
    assert run["horizon"] == 4 and run["total_steps"] == 30


def test_a_resume_whose_config_sets_another_horizon_uses_it_and_says_so(tmp_path):
    from pipemare import PipeMareConfig

    path = _saved(tmp_path, max_steps=30, stages=3, microbatches=2)  # horizon 4
    config = PipeMareConfig(reschedule_steps=10)
    t, notes = _resume(
        path,
        max_steps=40,
        about="continues the checkpointed run",
        stages=3,
        microbatches=2,
        config=config,
    )
    assert _horizon(t).horizon == 10 and t.global_step == 40
    assert len(notes) == 1, notes
    assert "T1's horizon changes from 4 steps (0.13 of the run's 30 steps) to 10 steps" in notes[0]
    assert "reschedule_steps from None to 10" in notes[0]


def test_a_restartable_torchrun_job_on_the_shared_store_is_warned():
    from pipemare.lightning.launching import restarts_share_the_store

    shared = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert restarts_share_the_store(shared)
    assert not restarts_share_the_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert not restarts_share_the_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not restarts_share_the_store({})
