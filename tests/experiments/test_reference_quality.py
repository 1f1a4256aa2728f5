"""The reference quality the advice quotes: the shipped data file is what the results in the
repository say, and the generator reads the horizon runs' curves as documented."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import pytest

from pipemare.experiments.studies.reference_quality import (
    DATA_FILE,
    PROTOCOL_RESULTS,
    reference_quality,
)
from pipemare.planner.reference import reference_cells

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_shipped_file_is_the_results_in_the_repository():
    """Regenerated in memory from the results, it equals the shipped file, and the planner
    reads every cell of it (through the package's resources, as an installed copy does).
    When it fails: ``python -P experiments/studies/reference_quality.py``."""
    shipped = json.loads((ROOT / DATA_FILE).read_text())
    assert json.loads(json.dumps(reference_quality(ROOT))) == shipped
    assert [dataclasses.asdict(c) for c in reference_cells()] == shipped["references"]
    for cell in shipped["references"]:
        assert cell["source"].startswith("experiments/results/")


def test_the_data_file_ships_with_the_package():
    """Named in the package data of the package it sits in, so a wheel carries it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = ".".join(DATA_FILE.parent.parts)
    assert package in config["packages"]
    assert DATA_FILE.name in config["package-data"][package]


def _curve_run(schedule: str, stages: int, n: int, seed: int, curve: list[list[float]]) -> dict:
    return {
        "schedule": schedule,
        "stages": stages,
        "microbatches": n,
        "seed": seed,
        "steps": 60,
        "lr": 0.001,
        "curve": curve,
        "final_val_loss": curve[-1][1],
        "setup": {"optimizer": "nanogpt"},
    }


def test_horizon_cells_are_read_from_the_seed_mean_curves(tmp_path):
    """One device's two seeds end at 2.0 and 2.2 (mean 2.1): their mean curve first comes within
    1% of 2.1 at step 40. pipemare's mean curve does at step 20 (a steps ratio of 0.5) and ends
    5% above; async's never does. A run at another rate is the re-tune, not a reference."""
    for source in PROTOCOL_RESULTS:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, tmp_path / source)
    horizon = tmp_path / "experiments" / "results" / "horizon"
    horizon.mkdir()
    runs = {
        "gpipe-P2-N1-s0": ("gpipe", 2, 1, 0, [[20, 3.0], [40, 2.1], [60, 2.0]]),
        "gpipe-P2-N1-s1": ("gpipe", 2, 1, 1, [[20, 3.2], [40, 2.1], [60, 2.2]]),
        "pipemare-P4-N4-s0": ("pipemare", 4, 4, 0, [[20, 2.1], [40, 2.2], [60, 2.2]]),
        "pipemare-P4-N4-s1": ("pipemare", 4, 4, 1, [[20, 2.1], [40, 2.2], [60, 2.21]]),
        "async-P4-N4-s0": ("async", 4, 4, 0, [[20, 3.0], [40, 2.5], [60, 2.3]]),
    }
    for name, run in runs.items():
        (horizon / f"gpt_c64s-{name}-60steps.json").write_text(json.dumps(_curve_run(*run)))
    (horizon / "gpt_c64s-gpipe-P2-N1-s0-60steps-lr0.002.json").write_text(
        json.dumps(_curve_run("gpipe", 2, 1, 0, [[20, 1.0], [40, 1.0], [60, 1.0]]))
    )
    cells = {
        (c["schedule"], c["stages"], c["microbatches"]): c
        for c in reference_quality(tmp_path)["references"]
        if c["task"] == "gpt_c64s"
    }
    assert sorted(cells) == [("async", 4, 4), ("pipemare", 4, 4)]
    pipemare, run_async = cells[("pipemare", 4, 4)], cells[("async", 4, 4)]
    assert pipemare["steps_ratio"] == 0.5 and run_async["steps_ratio"] is None
    assert pipemare["loss_gap"] == round(2.205 / 2.1 - 1, 4)
    assert pipemare["seeds"] == 2 and pipemare["steps"] == 60 and pipemare["lr"] == 0.001
    assert pipemare["family"] == "adam" and pipemare["reach"].startswith("the seed-mean curve")
