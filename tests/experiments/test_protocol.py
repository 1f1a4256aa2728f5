"""The fair protocol: its runs measure without disturbing training, and its outputs' schema."""

from __future__ import annotations

import dataclasses
import json
import math

from pipemare.experiments.studies import fair, protocol
from pipemare.experiments.studies.grid import VARIANTS
from pipemare.experiments.studies.protocol import TASKS, run_task


def test_evaluating_live_weights_leaves_the_trajectory_alone():
    task = dataclasses.replace(TASKS["digits"], eval_every=1)
    often = run_task(task, "pipemare", 4, 2, 1e-3, seed=3, steps=12)
    seldom = run_task(
        dataclasses.replace(task, eval_every=100), "pipemare", 4, 2, 1e-3, 3, steps=12
    )
    assert often.train_loss == seldom.train_loss  # no drain, no change
    assert len(often.metric) == 12 and len(seldom.metric) == 1
    assert often.metric[-1] == seldom.metric[-1]


def test_gpipe_and_1f1b_train_identically_so_one_run_stands_for_both():
    task = TASKS["digits"]
    a = run_task(task, "gpipe", 4, 2, 1e-3, seed=0, steps=8)
    b = run_task(task, "1f1b", 4, 2, 1e-3, seed=0, steps=8)
    assert a.train_loss == b.train_loss


def test_protocol_writes_a_table_with_each_schedule_at_its_best_rate(tmp_path):
    results = fair.run_protocol(
        tmp_path,
        ["digits"],
        ["gpipe", "async", "pipemare"],
        grid=((4, 1), (4, 2)),
        seeds=2,
        workers=1,
        steps=8,
        lrs=(1e-3, 3e-3),
        time_steps=1,
        extend=0,
    )
    runs = list((tmp_path / "runs").glob("*.json"))
    # gpipe: 2 rates + 1 more seed; async and pipemare: (2 rates + 1 seed) at 2 configurations
    assert len(runs) == 3 + 2 * 2 * 3
    digits = results["tasks"]["digits"]
    assert digits["tuned"] is False and digits["metric"] == "val_acc"
    rows = {(r["P"], r["N"], r["schedule"]): r for r in digits["rows"]}
    gpipe = rows[(4, 1, "gpipe")]
    assert gpipe["gap"] == 0.0 and gpipe["time_vs_gpipe"] == 1.0
    for key in [(4, 1, "async"), (4, 2, "pipemare")]:
        row = rows[key]
        assert row["lr"] in (1e-3, 3e-3) and len(row["seeds"]) == 2
        assert row["best"] == sum(row["seeds"]) / 2
        assert row["step_time_s"] > 0
    assert rows[(4, 16, "gpipe")]["step_time_s"] > 0  # gpipe's least-bubble N = 4P
    # the best rate is the one whose seed-0 run scored best
    sweep = {
        r["lr"]: r
        for r in map(json.loads, map(lambda p: p.read_text(), runs))
        if r["variant"] == "async" and r["microbatches"] == 1 and r["seed"] == 0
    }
    score = {lr: max(m for m in r["metric"] if math.isfinite(m)) for lr, r in sweep.items()}
    best = max(score, key=lambda lr: (score[lr], -lr))  # ties: the smaller rate
    assert rows[(4, 1, "async")]["lr"] == best
    text = (tmp_path / "results.md").read_text()
    assert "| 4 | 2 | pipemare |" in text and "gap to gpipe" in text
    # pipemare's verdict on each cell, in results.json and results.md
    assert [(c["task"], c["P"], c["N"]) for c in results["verdicts"]] == [
        ("digits", 4, 1),
        ("digits", 4, 2),
    ]
    assert "### pipemare against gpipe and async" in text and "| digits | 4 | 2 | " in text
    assert (tmp_path / "digits_protocol.png").stat().st_size > 0
    # a re-run finds every run done and trains nothing
    before = {p.name: p.stat().st_mtime_ns for p in runs}
    fair.run_protocol(
        tmp_path,
        ["digits"],
        ["gpipe", "async", "pipemare"],
        ((4, 1), (4, 2)),
        2,
        1,
        8,
        (1e-3, 3e-3),
        1,
        phase="table",
        extend=0,
    )
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")} == before


def test_a_best_rate_at_the_sweeps_edge_gets_the_next_one():
    assert [fair.next_rate(lr, up=True) for lr in (1e-4, 3e-4, 1e-3, 3e-3)] == [
        3e-4,
        1e-3,
        3e-3,
        1e-2,
    ]
    assert [fair.next_rate(lr, up=False) for lr in (1e-2, 3e-3, 1e-3, 3e-4)] == [
        3e-3,
        1e-3,
        3e-4,
        1e-4,
    ]


def test_each_task_trains_with_the_optimiser_its_name_gives():
    from pipemare.experiments.studies.protocol import OPTIMIZERS, _optimizer

    assert TASKS["plain@sgdm"].optimizer == "sgdm" and TASKS["plain"].optimizer == "adam"
    assert TASKS["plain@sgdm"].lrs == OPTIMIZERS["sgdm"] and not TASKS["plain"].tuned
    model = TASKS["plain"].build()
    assert len(model) == 16 and not any("Norm" in type(m).__name__ for m in model.modules())
    sgdm = _optimizer("sgdm", model, 1e-3)
    assert type(sgdm).__name__ == "SGD" and sgdm.param_groups[0]["momentum"] == 0.9
    # a GPT cut into traced segments still gives Muon its blocks' matrices, not the tied head
    gpt = TASKS["char_gpt@muon"].build()
    muon, rest = _optimizer("muon", gpt, 1e-3).param_groups
    assert muon["use_muon"] and len(muon["params"]) == 4 * 14  # qkv, proj, fc, out per block
    assert all(p.ndim == 2 for p in muon["params"]) and len(rest["params"]) > 0
    run = run_task(TASKS["plain@muon"], "pipemare", 4, 1, 1e-3, seed=0, steps=6)
    assert len(run.train_loss) == 6 and all(math.isfinite(v) for v in run.train_loss[3:])


def test_a_run_the_engine_stops_on_non_finite_gradients_is_a_divergence_not_a_crash():
    """A process pool sends a worker's exception back by pickling it: the engine's errors
    rebuild from their fields, and the protocol records such a run as diverged."""
    import pickle

    from pipemare import NonFiniteGradientError, NonFiniteLossError

    for error in (
        NonFiniteGradientError(3, 1, ["0.weight"], " (x)"),
        NonFiniteLossError(2, 4, 1e9),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
    run = run_task(TASKS["plain@sgd"], "async", 8, 1, 30.0, seed=0, steps=60)
    assert run.diverged and math.isnan(run.metric[-1]) and len(run.train_loss) < 60


def test_a_variant_the_optimiser_refuses_is_recorded_and_the_protocol_goes_on(tmp_path):
    # pipemare-SC insists on spike compensation, which Muon + AdamW refuses at setup
    results = fair.run_protocol(
        tmp_path,
        ["digits@muon"],
        ["gpipe", "pipemare-SC"],
        grid=((4, 1),),
        seeds=2,
        workers=1,
        steps=4,
        lrs=(1e-3, 3e-3),
        time_steps=2,
    )
    rows = {r["schedule"]: r for r in results["tasks"]["digits@muon"]["rows"] if r["N"] == 1}
    assert "spike_compensation=False" in rows["pipemare-SC"]["refused"]
    assert math.isfinite(rows["gpipe"]["best"])  # the other schedule ran and was tabulated
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*pipemare-SC*.json")]
    # two rates and the second seed, no rate beyond the sweep's edge for a refusal
    assert len(runs) == 3 and all(r["refused"] and not r["metric"] for r in runs)
    text = (tmp_path / "results.md").read_text()
    assert "| 4 | 1 | pipemare-SC | | refused at setup: " in text


def test_a_stored_run_set_up_otherwise_than_today_is_trained_again(tmp_path, capsys):
    # a run records what it resolved; a default that changes since makes its stored runs stale
    args = (tmp_path, ["digits"], ["gpipe", "pipemare"], ((4, 1),), 1, 1, 6, (1e-3,), 2)
    fair.run_protocol(*args, phase="runs", extend=0)
    path = {
        v: tmp_path / "runs" / f"digits-{v}-P4-N1-lr0.001-s0.json" for v in ("gpipe", "pipemare")
    }
    stored = json.loads(path["pipemare"].read_text())
    now = stored["setup"]
    assert now["schedule"] == "pipemare" and now["steps"] == 6 and now["optimizer"] == "adam"
    assert "lr_reschedule(horizon=" in now["corrections"]
    assert json.loads(path["gpipe"].read_text())["setup"]["corrections"] == ""
    # as if stored under an earlier default, and gpipe's run from before setups were recorded
    stored["setup"] = {**now, "corrections": "lr_reschedule(horizon=1)"}
    stored["metric"] = [-1.0]
    path["pipemare"].write_text(json.dumps(stored))
    legacy = json.loads(path["gpipe"].read_text())
    del legacy["setup"]
    path["gpipe"].write_text(json.dumps(legacy))
    capsys.readouterr()
    fair.run_protocol(*args, phase="runs", extend=0)
    told = capsys.readouterr().err
    again = json.loads(path["pipemare"].read_text())
    assert again["setup"] == now and again["metric"] != [-1.0]  # trained again
    assert "digits-pipemare-P4-N1-lr0.001-s0: set up differently now" in told
    assert "'lr_reschedule(horizon=1)' -> " in told
    assert json.loads(path["gpipe"].read_text()) == legacy  # used as it is, and counted
    assert "1 stored run(s) predate recorded setups" in told


def test_a_runs_setup_is_what_its_job_resolves_to_without_training():
    from pipemare.experiments.studies.grid import VARIANTS
    from pipemare.experiments.studies.protocol import run_setup

    for task, variant in [("plain@sgd", "pipemare"), ("digits@muon", "pipemare-SC")]:
        schedule, config = VARIANTS[variant]
        run = run_task(TASKS[task], schedule, 4, 1, 1e-3, seed=1, config=config, steps=3)
        assert run.setup == run_setup(TASKS[task], schedule, 4, 1, 1e-3, config, steps=3)
    plain_sgd = run_task(TASKS["plain@sgd"], "pipemare", 4, 1, 1e-3, seed=0, steps=2)
    assert "local_accumulation(crossed=1)" in plain_sgd.setup["corrections"]  # "auto" resolved
    assert "spike compensation supports" in run.setup["refused"]


def _row(p, n, schedule, best, spread, gpipe, diverged=0):
    gap = best - gpipe
    return {
        "P": p,
        "N": n,
        "schedule": schedule,
        "best": best,
        "spread": spread,
        "gap": gap,
        "relative_gap": gap / gpipe,
        "diverged": diverged,
    }


def test_the_verdicts_hold_pipemare_to_gpipes_margin_and_asyncs_spread():
    from pipemare.experiments.studies.fair_report import verdicts

    acc = [  # gpipe 0.95; accuracy: the margin is 2 points
        _row(8, 1, "gpipe", 0.95, 0.0, 0.95),
        _row(8, 1, "async", 0.90, 0.01, 0.95),
        _row(8, 1, "pipemare", 0.935, 0.01, 0.95),  # 1.5 points short: within
        _row(16, 1, "async", 0.90, 0.01, 0.95),
        _row(16, 1, "pipemare", 0.87, 0.01, 0.95),  # 3 below async, spreads 2: below
        _row(8, 4, "async", 0.90, 0.02, 0.95, diverged=0),
        _row(8, 4, "pipemare", 0.89, 0.02, 0.95, diverged=1),  # 6 short, 1 below async; diverged
        {"P": 16, "N": 4, "schedule": "pipemare", "refused": "no"},
    ]
    loss = [  # gpipe 2.0; loss: the margin is 2% of it
        _row(8, 1, "gpipe", 2.0, 0.0, 2.0),
        _row(8, 1, "async", 2.2, 0.01, 2.0),
        _row(8, 1, "pipemare", 2.05, 0.01, 2.0),  # +2.5%: outside
        _row(16, 1, "async", 2.1, 0.02, 2.0),
        _row(16, 1, "pipemare", 2.03, 0.02, 2.0),  # +1.5%: within
    ]
    grid = [(8, 1), (16, 1), (8, 4), (16, 4)]
    results = {
        "grid": grid,
        "tasks": {
            "a": {"higher_is_better": True, "rows": acc},
            "l": {"higher_is_better": False, "rows": loss},
        },
    }
    got = {
        (c["task"], c["P"], c["N"]): (c["within_margin"], c["below_baseline"], c["diverged_alone"])
        for c in verdicts(results)
    }
    assert got == {
        ("a", 8, 1): (True, False, False),
        ("a", 16, 1): (False, True, False),
        ("a", 8, 4): (False, False, True),
        ("l", 8, 1): (False, False, False),
        ("l", 16, 1): (True, False, False),
    }  # the refused cell and the cells the grid has no runs for are left out


def test_step_times_take_every_configurations_windows_in_turn(monkeypatch):
    """A drift of the machine's speed while a sitting lasts must fall on every configuration
    alike: window r of each configuration is timed before window r + 1 of any. A layout the
    pipeline refuses is NaN, and times no window."""
    order: list[tuple[str, int]] = []
    real = protocol.timed_window

    def timed(pipe, *args, **kwargs):
        order.append((pipe.schedule, pipe.microbatches))
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(protocol, "timed_window", timed)
    keys = [("1f1b", 2, 2), ("pipemare", 2, 4), ("gpipe", 64, 1)]  # 17 layers: no 64 stages
    found = protocol.interleaved_step_times(TASKS["digits"], keys, steps=1, warm=1, repeats=2)
    assert order == [("1f1b", 2), ("pipemare", 4)] * 2
    assert all(found[k]["free"] > 0 for k in keys[:2])
    assert math.isnan(found[keys[2]]["free"])
    one = protocol.step_times(TASKS["digits"], "pipemare", 2, 4, steps=1, warm=1, repeats=1)
    assert set(one) == {"free"} and one["free"] > 0


def test_step_times_run_a_named_variant_with_its_own_corrections(monkeypatch):
    """``pipemare-noWP`` is timed as the pipemare schedule without weight prediction, the
    default beside it with it: a sitting that timed the default twice would compare nothing."""
    ran: dict[str, list[str]] = {}
    real = protocol.timed_window

    def timed(pipe, *args, **kwargs):
        ran.setdefault(pipe.schedule, []).append(
            ",".join(sorted(c.name for c in pipe.optimizer.corrections))
        )
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(protocol, "timed_window", timed)
    keys = [("pipemare", 2, 2), ("pipemare-noWP", 2, 2)]
    found = protocol.interleaved_step_times(
        TASKS["digits"], keys, steps=1, warm=1, repeats=1, variants=VARIANTS
    )
    assert set(found) == set(keys) and all(found[k]["free"] > 0 for k in keys)
    default, without = ran["pipemare"]
    assert "weight_prediction" in default.split(",")
    assert without.split(",") == [c for c in default.split(",") if c != "weight_prediction"]
