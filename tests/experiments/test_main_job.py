"""The main job (``pipemare study default``): a slice of the user's protocol that trains every run
it reports, keeps its measured times for a rerun, answers in a user's words, logs to W&B and
opens its dashboard with the answer."""

from __future__ import annotations

import html
import json
import math

import pytest

from pipemare.experiments.studies import main_job, protocol, user_protocol
from pipemare.experiments.studies.protocol import TASKS


def test_the_main_jobs_tasks_are_the_protocols_with_a_compute_and_a_dispatch_bound_one():
    assert set(main_job.RUNS) <= set(TASKS)
    assert main_job.STAGES == (4,)
    gpt = TASKS["gpt_c64s"]
    assert (gpt.optimizer, gpt.warmup, gpt.cosine, gpt.tuned) == ("nanogpt", 0.1, True, False)
    assert len(gpt.build()) >= 8  # the full protocol's P = 8 cuts it
    for name in main_job.RUNS:  # AdamW, as the user trains
        assert TASKS[name].optimizer in ("adamw", "nanogpt")


def test_the_main_job_trains_what_it_reports_and_keeps_its_times(tmp_path, monkeypatch):
    """One small task end to end, twice into one directory: the second run measures nothing
    (the stored times are reused) but trains every run again, and gives the same quality."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    # two short windows per configuration: what is stored and reused, not its precision
    monkeypatch.setattr(main_job, "TIMING", {"steps": 2, "warm": 1, "repeats": 2})
    out = tmp_path / "default"
    first = main_job.run_main_job(out, runs={"digits": (3e-3, 8)}, workers=1, wandb=True)
    task = first["tasks"]["digits"]
    stage = task["stages"]["4"]
    # 1F1B timed at every N dividing the batch, the fastest its baseline
    by_n = {int(n): s for n, s in stage["1f1b"]["step_times_by_n"].items()}
    assert sorted(by_n) == user_protocol.one_f_one_b_ns(TASKS["digits"], 4)
    assert stage["1f1b"]["N"] == min(by_n, key=lambda n: (by_n[n], n))
    default_n = user_protocol.auto_n(TASKS["digits"], 4)
    shown = {(r["schedule"], r["N"]) for r in stage["rows"]}
    assert {("pipemare", default_n), ("async", default_n)} <= shown
    assert ("gpipe (pipemare's N)", default_n) in shown
    assert task["regime"] in ("compute-bound", "dispatch-bound")
    # every run it reports, trained now: two seeds of gpipe, async and pipemare
    trained = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert len(trained) == 6 and all("-s0" in n or "-s1" in n for n in trained)
    # the answer, in a user's words
    (line,) = first["answer"]
    assert f"pipemare (N = {default_n})" in line and f"1F1B (N = {stage['1f1b']['N']})" in line
    assert "P = 4" in line and "at equal steps" in line and "rate 0.003" in line
    # each timing round's own ratio of pipemare's step to 1F1B's, beside the medians' reading
    rounds = json.loads((out / "step_rounds.json").read_text())
    assert all(len(windows) == 2 for windows in rounds.values())
    assert set(rounds) == set(json.loads((out / "step_times.json").read_text()))
    each = user_protocol.round_ratios(
        rounds, f"digits-pipemare-P4-N{default_n}", f"digits-1f1b-P4-N{stage['1f1b']['N']}"
    )
    assert f"{min(each):.2f}-{max(each):.2f}x in the 2 timing rounds" in line
    assert (out / "results.md").read_text().startswith(f"- {line}")
    # beside it, the stored long-horizon study, labelled as such (the repository's file)
    assert main_job.stored_lines() and main_job.stored_lines(main_job.HALVES)
    assert first["stored"] == main_job.stored_lines() + main_job.stored_lines(main_job.HALVES)
    assert "Stored, not run now:" in (out / "results.md").read_text()
    # one W&B run per reported series and seed (1F1B, gpipe, async, pipemare), offline
    assert len(list((out / "wandb").glob("offline-run-*"))) == 8
    times = (out / "step_times.json").read_text()

    def measured(*args, **kwargs):
        raise AssertionError("a rerun into the same directory measured a step time again")

    monkeypatch.setattr(protocol, "interleaved_step_times", measured)
    for path in (out / "runs").glob("*.json"):  # marked, so that a reused run shows
        path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": -1.0}))
    second = main_job.run_main_job(out, runs={"digits": (3e-3, 8)}, workers=1, wandb=False)
    assert (out / "step_times.json").read_text() == times
    assert all(json.loads(p.read_text())["seconds"] >= 0 for p in (out / "runs").glob("*.json"))
    again = second["tasks"]["digits"]["stages"]["4"]
    for a, b in zip(stage["rows"], again["rows"], strict=True):  # the same quality columns
        assert (a["schedule"], a["N"]) == (b["schedule"], b["N"])
        assert a["final"] == b["final"] or (math.isnan(a["final"]) and math.isnan(b["final"]))

    # the dashboard opens with the answer, before any figure or table
    from pipemare.experiments.dashboard.answer_page import write_answer_page

    page = write_answer_page(out).read_text()
    assert page.index("<ul><li>") < page.index("<img") < page.index("<table>")
    assert page.index(html.escape(line)) < page.index("<img")
    for schedule in ("pipemare", "1f1b", "gpipe", "async"):  # each named with its N and rate
        assert f"<td>{schedule}</td>" in page
    assert page.count("<td>0.003</td>") == 4
    assert page.count("<img") == 2  # the task against pipeline time, the staleness per stage
    # under the answer's curves, the stored longer study as one table: a row per stored line
    stored_at = page.index("Stored, not run now")
    assert page.index("<img") < stored_at < page.index("<h2>digits")
    table = page[stored_at : page.index("</table>", stored_at)]
    assert table.count("<tr>") == 1 + len(first["stored"])


def test_the_dashboard_says_what_to_run_without_results(tmp_path):
    from pipemare.experiments.dashboard.answer_page import write_answer_page

    with pytest.raises(ValueError, match="pipemare study default"):
        write_answer_page(tmp_path)


def _verdict_file(path, cells, sittings=None):
    base = {"steps": 2400, "lr": 1e-3, "seeds": [0, 1], "spread": 0.01, "reach": 1900}
    study = {
        "task": "gpt_c64s",
        "task_rate": 1e-3,
        "main_job_steps": 240,
        "cells": [{**base, **c} for c in cells],
    }
    if sittings is not None:
        study["sitting_step_ratios"] = sittings
    path.write_text(json.dumps(study))
    return path


def test_the_stored_study_is_shown_at_its_longest_horizon_with_its_length_and_rate(tmp_path):
    one = {"schedule": "gpipe", "P": None, "N": None, "mean": 2.0, "gap": None}
    cells = [
        one,
        {"schedule": "pipemare", "P": 4, "N": 4, "mean": 1.98, "gap": -0.01, "time_vs_1f1b": 0.8},
        {"schedule": "async", "P": 4, "N": 4, "mean": 2.06, "gap": 0.03, "reach": None},
        {"schedule": "pipemare", "P": 4, "N": 8, "mean": 1.9, "gap": -0.05, "time_vs_1f1b": 0.5},
        {"schedule": "pipemare", "P": 4, "N": 4, "steps": 960, "mean": 2.2, "gap": 0.1},
        {"schedule": "pipemare", "P": 8, "N": 8, "lr": 2e-3, "mean": 2.0, "gap": 0.002},
    ]
    lines = main_job.stored_lines(_verdict_file(tmp_path / "verdict.json", cells))
    # the longest horizon only, at the default N only (N = 8 at P = 4 is not the default)
    assert len(lines) == 2 and not any("960" in line or "0.50x" in line for line in lines)
    first, retuned = lines
    assert "2,400 steps (10x this job's 240)" in first and "the task's rate" in first
    assert "pipemare (N = 4) ends -1.0% (± 0.5% over 2 seeds)" in first
    assert "0.80x 1F1B's time" in first
    assert "async (N = 4): +3.0%" in first and "does not reach 1F1B's quality" in first
    assert "rate 0.002 (a rate of the one-device re-tune), P = 8" in retuned
    assert "step time not measured" in retuned
    assert main_job.stored_lines(tmp_path / "absent.json") == []
    # the same cells as the dashboard's rows, and its table's cells
    from pipemare.experiments.dashboard.answer_page import stored_table

    rows = main_job.stored_rows(tmp_path / "verdict.json")
    assert [r["line"] for r in rows] == lines
    assert rows[0]["pipemare"] == {
        "gap": -0.01,
        "spread": pytest.approx(0.005),
        "seeds": 2,
        "reaches": True,
        "time_vs_1f1b": 0.8,
    }
    assert not rows[0]["async"]["reaches"] and rows[1]["async"] is None
    page = "".join(stored_table({"stored_rows": rows}))
    assert "<td>-1.0% ± 0.5% (2 seeds)</td><td>0.80x</td>" in page
    assert "<td>+3.0% (never reaches it)</td>" in page
    assert "<td>0.002 (re-tuned)</td>" in page and "<td>not timed</td>" in page


def test_the_stored_line_gives_the_spread_of_the_sittings_own_step_ratios(tmp_path):
    """Where the verdict carries each timing sitting's own step ratio, the line at the task's
    rate gives pipemare's step with the range of those ratios; a re-tuned rate's line does not."""
    cells = [
        {"schedule": "gpipe", "P": None, "N": None, "mean": 2.0, "gap": None},
        {"schedule": "pipemare", "P": 4, "N": 4, "mean": 1.98, "gap": -0.01, "step_vs_1f1b": 0.92},
        {"schedule": "pipemare", "P": 4, "N": 4, "lr": 2e-3, "mean": 2.0, "gap": 0.0},
    ]
    sittings = {"P4": {"each": [0.94, 0.78, 0.92], "median": 0.92}}
    first, retuned = main_job.stored_lines(_verdict_file(tmp_path / "v.json", cells, sittings))
    assert "its step 0.92x 1F1B's" in first and "each of 3 timing sittings" in first
    assert "ranged 0.78-0.94x" in first
    assert "sittings" not in retuned
