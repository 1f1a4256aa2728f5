"""The horizon study's table: the committed README and verdict.json are what the curves in the
repository give, and the verdict reads each rate's cells against one device at that rate."""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics

import pytest

from pipemare.experiments.studies import horizon

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments" / "results" / "horizon"


def _copy_inputs(to: pathlib.Path) -> None:
    to.mkdir()
    for path in [*OUT.glob("gpt_c64s-*steps*.json"), *OUT.glob("step_times-*.json")]:
        shutil.copy(path, to / path.name)
    shutil.copy(OUT / "README.template.md", to / "README.template.md")


def test_the_committed_readme_and_verdict_are_what_the_curves_give(tmp_path):
    """When it fails: ``python -P experiments/studies/horizon.py table``."""
    _copy_inputs(tmp_path / "h")
    horizon.main(["table", "--out", str(tmp_path / "h")])
    for name in ("README.md", "verdict.json"):
        assert (tmp_path / "h" / name).read_text() == (OUT / name).read_text(), name


def _run(schedule: str, p: int, seed: int, lr: float, curve: list[tuple[int, float]]) -> dict:
    return {
        "schedule": schedule,
        "stages": p,
        "microbatches": 1 if schedule == "gpipe" else p,
        "seed": seed,
        "steps": 40,
        "lr": lr,
        "curve": [list(c) for c in curve],
        "final_val_loss": curve[-1][1],
    }


def _table(out: pathlib.Path, runs: list[dict], times: dict[str, float]) -> list[dict]:
    """``horizon.py table`` over ``runs`` and one sitting's ``times`` in ``out``: its verdict's
    cells (the README is written beside them)."""
    out.mkdir()
    shutil.copy(OUT / "README.template.md", out / "README.template.md")
    for i, r in enumerate(runs):
        (out / f"gpt_c64s-{i}-40steps.json").write_text(json.dumps(r))
    (out / "step_times-1.json").write_text(json.dumps(times))
    horizon.main(["table", "--out", str(out)])
    return json.loads((out / "verdict.json").read_text())["cells"]


def test_each_rate_is_judged_against_one_device_at_that_rate(tmp_path):
    """At 1e-3 one device ends at 2.0 (seeds 2.0, 2.0) and pipemare at 2.1 (+5%, never within
    1%); at 2e-3 one device ends at 1.8 and pipemare at 1.8 (+0%, within 1% at step 20).
    1F1B's fastest N is 4 (40 ms), pipemare's step 20 ms: at 2e-3 one device reaches its
    final at step 40, pipemare at 20, so 20 x 20 ms against 40 x 40 ms is 0.25."""
    out = tmp_path / "h"
    runs = [
        _run("gpipe", 2, 0, 1e-3, [(20, 2.5), (40, 2.0)]),
        _run("gpipe", 2, 1, 1e-3, [(20, 2.5), (40, 2.0)]),
        _run("pipemare", 4, 0, 1e-3, [(20, 2.6), (40, 2.1)]),
        _run("gpipe", 2, 0, 2e-3, [(20, 2.2), (40, 1.8)]),
        _run("pipemare", 4, 0, 2e-3, [(20, 1.81), (40, 1.8)]),
    ]
    times = {
        "gpt_c64s-1f1b-P4-N4": 0.04,
        "gpt_c64s-1f1b-P4-N8": 0.05,
        "gpt_c64s-pipemare-P4-N4": 0.02,
    }
    cells = _table(out, runs, times)
    at = {(c["lr"], c["schedule"]): c for c in cells}
    slow, fast = at[1e-3, "pipemare"], at[2e-3, "pipemare"]
    assert abs(slow["gap"] - 0.05) < 1e-9 and slow["reach"] is None
    assert slow["time_vs_1f1b"] is None and slow["one_f_one_b_n"] == 4
    assert abs(fast["gap"]) < 1e-9 and fast["reach"] == 20
    assert abs(fast["time_vs_1f1b"] - 0.25) < 1e-9 and abs(fast["step_vs_1f1b"] - 0.5) < 1e-9
    readme = (out / "README.md").read_text()
    assert "### At 0.002, every schedule (one device included) at this rate" in readme
    # its gap along the run, against one device at 2e-3: 1.81 / 2.2 at step 20 (half the run)
    retuned = readme.split("### At 0.002", 1)[1].split("\n## ", 1)[0]  # to the next section
    assert "The gap along the run at this rate" in retuned
    (row,) = [line for line in retuned.splitlines() if line.startswith("| 40 | pipemare | 4 |")]
    assert "-17.7% (step 20)" in row and "+0.0% (step 40)" in row


def test_t3s_synchronous_steps_are_charged_at_1f1bs_step(tmp_path):
    """T3 (``pipemare+T3w10``: the first 10 steps run 1F1B) reaches one device's final loss at
    step 20: 10 steps at 1F1B's 40 ms at its own P and N, then 10 at pipemare's 20 ms, 0.6 s
    against 1F1B's 40 x 40 ms = 1.6 s, so 0.375 of 1F1B's time (0.25 if the synchronous steps
    were charged at pipemare's step)."""
    runs = [
        _run("gpipe", 2, 0, 1e-3, [(20, 2.5), (40, 2.0)]),
        _run("pipemare+T3w10", 4, 0, 1e-3, [(20, 2.01), (40, 2.0)]),
    ]
    times = {"gpt_c64s-1f1b-P4-N4": 0.04, "gpt_c64s-pipemare-P4-N4": 0.02}
    cells = _table(tmp_path / "h", runs, times)
    (t3,) = [c for c in cells if c["schedule"] == "pipemare+T3w10"]
    assert t3["reach"] == 20 and abs(t3["step_vs_1f1b"] - 0.5) < 1e-9
    assert abs(t3["time_vs_1f1b"] - 0.375) < 1e-9


def test_the_tables_read_the_sittings_whose_windows_were_taken_in_turn(tmp_path):
    """Sittings that timed one configuration after another are read only where no sitting took
    its windows in turn, and none of them is extended in the new way."""
    old = {"gpt_c64s-1f1b-P4-N4": 0.04, "gpt_c64s-pipemare-P4-N4": 0.04}
    new = {"_method": "interleaved", "gpt_c64s-1f1b-P4-N4": 0.04, "gpt_c64s-pipemare-P4-N4": 0.02}
    (tmp_path / "step_times-1.json").write_text(json.dumps(old))
    assert horizon._sittings(tmp_path) == [old]
    (tmp_path / "step_times-2.json").write_text(json.dumps(new))
    assert horizon._sittings(tmp_path) == [new]
    with pytest.raises(SystemExit, match="give a new --sitting"):
        horizon.main(["times", "--out", str(tmp_path), "--sitting", "1", "--stages", "4"])


def test_the_tables_read_the_sittings_of_the_engine_timed_now(tmp_path):
    """Once a sitting timed the engine as it is now, the sittings of an earlier engine (hooked
    stages, slower steps) are left out of the medians, and none of them is extended."""
    times = {"gpt_c64s-1f1b-P4-N4": 0.04}
    before = {"_method": "interleaved", **times, "gpt_c64s-pipemare-P4-N4": 0.04}
    now = {"_method": "interleaved", "_engine": horizon.ENGINE, **times}
    (tmp_path / "step_times-8.json").write_text(json.dumps(before))
    assert horizon._sittings(tmp_path) == [before]
    (tmp_path / "step_times-16.json").write_text(
        json.dumps(now | {"gpt_c64s-pipemare-P4-N4": 0.03})
    )
    assert [s["gpt_c64s-pipemare-P4-N4"] for s in horizon._sittings(tmp_path)] == [0.03]
    with pytest.raises(SystemExit, match="another engine: give a new --sitting"):
        horizon.main(["times", "--out", str(tmp_path), "--sitting", "8", "--stages", "2"])


def test_a_sitting_is_not_extended_by_a_configuration_timed_alone(tmp_path):
    """A configuration added to the study after a sitting (``pipemare-noWP``) is not timed into
    that sitting on its own, where its windows would not alternate with the others'."""
    from pipemare.experiments.studies.protocol import TASKS
    from pipemare.experiments.studies.user_protocol import auto_n, one_f_one_b_ns

    n = auto_n(TASKS["gpt_c64s"], 2)
    keys = [f"gpt_c64s-1f1b-P2-N{m}" for m in one_f_one_b_ns(TASKS["gpt_c64s"], 2)]
    keys += [f"gpt_c64s-{v}-P2-N{n}" for v in ("gpipe", "async", "pipemare")]
    keys += [f"gpt_c64s-pipemare-P2-N{2 * n}"]
    sitting = {"_method": "interleaved", "_engine": horizon.ENGINE, **dict.fromkeys(keys, 0.05)}
    (tmp_path / "step_times-9.json").write_text(json.dumps(sitting))
    with pytest.raises(SystemExit, match=r"pipemare-noWP.*give a new --sitting"):
        horizon.main(["times", "--out", str(tmp_path), "--sitting", "9", "--stages", "2"])


def test_a_configuration_timed_in_fewer_sittings_keeps_its_ratio_within_them():
    """``pipemare-noWP``, timed in the later sittings only, is compared with 1F1B's fastest N
    within those sittings, not with 1F1B's median over every sitting."""
    fast = {"gpt_c64s-1f1b-P4-N4": 0.040, "gpt_c64s-1f1b-P4-N8": 0.050}
    slow = {"gpt_c64s-1f1b-P4-N4": 0.080, "gpt_c64s-1f1b-P4-N8": 0.090}
    late = {**slow, "gpt_c64s-pipemare-noWP-P4-N4": 0.060}
    times = horizon._median_times([fast, fast, late])
    assert times["gpt_c64s-1f1b-P4-N4"] == pytest.approx(0.040)
    assert times["gpt_c64s-pipemare-noWP-P4-N4"] / times["gpt_c64s-1f1b-P4-N4"] == pytest.approx(
        0.060 / 0.080
    )


def test_the_tables_read_each_configuration_within_its_sitting():
    """Each configuration is read against its own sitting's fastest 1F1B: a sitting in which
    the machine ran slower throughout moves no ratio, and the tables' step ratio of the default
    is the median of the sittings' own ratios that the verdict carries. A median of each
    configuration's own steps would compare one sitting's pipemare with another's 1F1B (0.8
    here, against the sittings' own 0.9)."""
    sittings = [
        {
            "gpt_c64s-1f1b-P4-N4": 0.040,
            "gpt_c64s-1f1b-P4-N8": 0.045,
            "gpt_c64s-pipemare-P4-N4": 0.040,
        },
        {
            "gpt_c64s-1f1b-P4-N4": 0.060,
            "gpt_c64s-1f1b-P4-N8": 0.070,
            "gpt_c64s-pipemare-P4-N4": 0.030,
        },
        {
            "gpt_c64s-1f1b-P4-N4": 0.055,
            "gpt_c64s-1f1b-P4-N8": 0.050,
            "gpt_c64s-pipemare-P4-N4": 0.045,
        },
    ]
    times = horizon._median_times(sittings)
    fastest = min(horizon._one_f_one_b(times, 4).values())
    ratios = horizon._sitting_ratios(sittings)["P4"]
    assert ratios["each"] == [1.0, 0.5, 0.9]
    assert times["gpt_c64s-pipemare-P4-N4"] / fastest == pytest.approx(ratios["median"])
    # each configuration's median of its own steps would read 0.040 / 0.050 = 0.8 here
    own = statistics.median(s["gpt_c64s-pipemare-P4-N4"] for s in sittings)
    assert own / 0.050 == pytest.approx(0.8)
    slower = [sittings[0], {k: 1.5 * v for k, v in sittings[1].items()}, sittings[2]]
    again = horizon._median_times(slower)
    assert again["gpt_c64s-pipemare-P4-N4"] / min(
        horizon._one_f_one_b(again, 4).values()
    ) == pytest.approx(0.9)
