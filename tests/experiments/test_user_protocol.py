"""The user's protocol (``pipemare user-protocol``): its baseline's N and its verdicts."""

from __future__ import annotations

import pytest

from pipemare.experiments.studies import user_protocol
from pipemare.experiments.studies.protocol import TASKS


def test_1f1b_is_timed_at_every_n_dividing_the_batch_and_pipemare_at_the_default():
    task = TASKS["char_gpt@adamw"]  # batch 16
    assert user_protocol.one_f_one_b_ns(task, 2) == [1, 2, 4, 8, 16]
    assert user_protocol.one_f_one_b_ns(TASKS["gpt_c64"], 8) == [1, 2, 4, 8, 16, 32]
    assert [user_protocol.auto_n(task, p) for p in user_protocol.STAGES] == [2, 4, 8]
    assert user_protocol.HELD_OUT in user_protocol.USER_TASKS
    assert not TASKS[user_protocol.HELD_OUT].tuned


def _row(final, time, async_final, spread=0.0, async_spread=0.0):
    return {
        "final": final,
        "spread": spread,
        "time_vs_1f1b": time,
        "async": async_final,
        "async_spread": async_spread,
    }


@pytest.mark.parametrize(
    ("row", "bound", "expected"),
    [
        (_row(2.04, 0.79, 2.10), 0.5, (True, True, True)),  # +2%, 0.79 of 1F1B's time
        (_row(2.05, 0.79, 2.10), 0.5, (False, True, True)),  # +2.5%: quality missed
        (_row(2.04, 0.85, 2.10), 0.5, (True, False, True)),  # slower than 0.8
        (_row(2.04, 0.85, 2.10), 0.82, (True, True, True)),  # within the bubble bound + 0.05
        (_row(2.04, 0.5, 2.00, 0.01, 0.01), 0.5, (True, True, False)),  # below async
        (_row(2.04, 0.5, 2.00, 0.02, 0.02), 0.5, (True, True, True)),  # within the spread
    ],
)
def test_verdicts_follow_the_issues_bar_for_a_loss(row, bound, expected):
    baseline = {"final": 2.0, "bubble_bound": bound}
    got = user_protocol.verdict(row, baseline, higher=False)
    assert (got["quality"], got["sooner"], got["not_below_async"]) == expected


def test_verdicts_for_accuracy_count_points():
    baseline = {"final": 0.95, "bubble_bound": 0.5}
    assert user_protocol.verdict(_row(0.941, 0.7, 0.93), baseline, higher=True)["quality"]
    assert not user_protocol.verdict(_row(0.939, 0.7, 0.93), baseline, higher=True)["quality"]


def test_a_faster_schedule_gets_its_extra_steps_at_1f1bs_pipeline_time():
    """pipemare's runs at equal pipeline time: the task's steps times 1F1B's step (at its
    fastest N) over pipemare's, the rate schedule stretched; their key tells them apart."""
    task = TASKS["gpt_c64"]  # 300 steps, batch 32
    times = {
        f"gpt_c64-1f1b-P{p}-N{n}": 0.9 + 0.1 / n for p in (2, 4, 8) for n in (1, 2, 4, 8, 16, 32)
    }
    times |= {"gpt_c64-1f1b-P4-N8": 0.8, "gpt_c64-pipemare-P4-N4": 0.6}
    jobs = user_protocol.equal_time_jobs("gpt_c64", 1e-3, 2, times, None)
    assert list(jobs) == [4]  # no pipemare time at P = 2 or 8: nothing to give them
    assert [(j.steps, j.seed, j.variant, j.microbatches) for j in jobs[4]] == [
        (400, 0, "pipemare", 4),
        (400, 1, "pipemare", 4),
    ]
    assert jobs[4][0].key.endswith("-s0-time400") and task.steps == 300


def test_a_tasks_regime_is_read_from_its_cost_per_row():
    assert user_protocol.regime({32: 9.1e-3, 8: 9.4e-3, 4: 10.0e-3}) == "compute-bound"
    assert user_protocol.regime({16: 1.2e-3, 2: 3.9e-3}) == "dispatch-bound"


def test_the_cost_per_row_takes_the_sizes_in_turn_and_is_kept_for_a_rerun(tmp_path, monkeypatch):
    """Each size the default layouts run (the batch, and batch / N at each P), measured in turn
    round after round so a slower minute falls on every size alike; a rerun reuses the file."""
    import dataclasses
    import json

    from torch import nn

    seen: list[int] = []

    class Counted(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(len(x))
            return self.inner(x)

    task = TASKS["char_gpt@adamw"]  # batch 16, N = 2, 4, 8 at P = 2, 4, 8
    counted = dataclasses.replace(task, build=lambda: Counted(task.build()))
    monkeypatch.setitem(TASKS, "char_gpt@adamw", counted)
    costs = user_protocol.measure_cost_per_row(tmp_path, ["char_gpt@adamw"], repeats=3)
    assert sorted(int(r) for r in costs["char_gpt@adamw"]) == [2, 4, 8, 16]
    assert all(s > 0 for s in costs["char_gpt@adamw"].values())
    assert seen[:8] == [2, 4, 8, 16, 4, 8, 16, 2]  # every size each round, starting one later
    assert len(seen) == 4 * (3 + 1)
    assert json.loads((tmp_path / "cost_per_row.json").read_text()) == costs
    user_protocol.measure_cost_per_row(tmp_path, ["char_gpt@adamw"], repeats=3)
    assert len(seen) == 16  # measured once
