"""``pipemare bench`` at a tiny size: its output's shape and bookkeeping, never its speed."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from support.launch import run

pytestmark = pytest.mark.distributed

MEMORY = ("weights", "optimizer", "stash", "buffers", "activations")


def test_bench_writes_one_json_line_per_configuration_a_table_and_a_chart(tmp_path):
    cmd = [
        sys.executable, "-m", "pipemare.experiments.bench", "--out", str(tmp_path),
        "--processes", "2", "--width", "16", "--depth", "3", "--batch", "8",
        "--microbatches", "2", "--steps", "8", "--memory-steps", "8", "--warmup", "2",
        "--schedules", "pipedream", "pipemare", "--memory-stages", "2", "3",
        "--compile",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="offline")
    proc = run(cmd, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    kinds = [(r["kind"], r["schedule"]) for r in rows]
    assert kinds[0] == ("single", "-")
    assert {("torch", s) for s in ("GPipe", "1F1B")} <= set(kinds)
    for kind in ("engine", "lightning", "engine+compile"):  # any schedule: the same bench code
        assert {(kind, s) for s in ("pipedream", "pipemare")} <= set(kinds)
    assert ("single+compile", "-") in kinds
    for r in rows:
        if "error" in r:
            assert r["kind"] == "torch" and r["error"].startswith("unsupported")
            continue
        stages = 1 if r["kind"].startswith("single") else 2
        assert r["samples_per_s"] > 0 and len(r["utilisation"]) == stages
        assert all(0 <= u <= 1.0 + 1e-6 for u in r["utilisation"])
        assert 0 <= r["bubble"] <= 1 and len(r["comm_s"]) == stages
        assert len(r["memory"]) == stages and all(set(MEMORY) <= set(m) for m in r["memory"])
        assert all(m["weights"] > 0 for m in r["memory"])
        assert r["vs_single"] == pytest.approx(r["samples_per_s"] / rows[0]["samples_per_s"])
        if r["kind"] == "engine+compile":  # against the same schedule's eager row
            eager = next(
                e for e in rows if e["kind"] == "engine" and e["schedule"] == r["schedule"]
            )
            assert r["vs_eager"] == pytest.approx(r["samples_per_s"] / eager["samples_per_s"])
            assert r["warmup_s"] > 0
        if r["kind"] in ("engine", "lightning", "engine+compile"):  # memory over 8 steps
            growth = r["resident_mb_per_1000"]
            assert len(growth) == stages and all(math.isfinite(g) for g in growth)
    assert "resident MB per 1,000 steps" in (tmp_path / "bench.md").read_text()
    one_f_one_b = next(r for r in rows if r["schedule"] == "1F1B")
    assert one_f_one_b["vs_torch_1f1b"] == pytest.approx(1.0)
    # only pipedream stashes weights; only a corrected schedule keeps correction buffers
    stash = {(r["kind"], r["schedule"]): r["memory"][0]["stash"] for r in rows if "memory" in r}
    assert stash[("engine", "pipedream")] > 0 and stash[("engine", "pipemare")] == 0
    # compiled stages keep the no-stash backward: no copies, saving no more than eager
    assert stash[("engine+compile", "pipemare")] == 0
    saved = {
        (r["kind"], r["schedule"]): r["memory"][0]["saved_peak"]
        for r in rows
        if r["kind"] in ("engine", "engine+compile")
    }
    assert 0 < saved[("engine+compile", "pipemare")] <= saved[("engine", "pipemare")]
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert [m["stages"] for m in memory] == [2, 3]
    for m in memory:
        assert m["stash_measured"] == m["stash_analytic"]
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "| P | kind |" in (tmp_path / "bench.md").read_text()


def test_bench_measures_copies_of_a_pipeline_in_a_four_process_launch(tmp_path):
    cmd = [
        sys.executable, "-m", "pipemare.experiments.bench", "--out", str(tmp_path),
        "--processes", "4", "--width", "16", "--depth", "3", "--batch", "8",
        "--microbatches", "2", "--steps", "2", "--warmup", "2",
        "--schedules", "pipemare", "--memory-stages", "2",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="offline")
    proc = run(cmd, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    (copies,) = [r for r in rows if r.get("copies")]
    assert (copies["kind"], copies["schedule"]) == ("lightning", "pipemare, 2 copies x 2 stages")
    assert copies["stages"] == 2 and copies["processes"] == 4
    assert len(copies["utilisation"]) == 4 and 0 <= copies["bubble"] <= 1
    assert all(0 < u <= 1.0 + 1e-6 for u in copies["utilisation"])  # every rank computed
    assert "of_stage_bound" not in copies  # the 4-stage bound does not apply to it
    assert copies["samples_per_s"] > 0 and len(copies["memory"]) == 4
    assert "resident_mb_per_1000" not in copies  # 2 steps are too few for a slope
    # the copies hold the same stage: equal weights on ranks 0 and 2, and on 1 and 3
    w = [m["weights"] for m in copies["memory"]]
    assert w[0] == w[2] and w[1] == w[3]
    assert "2 copies x 2 stages" in (tmp_path / "bench.md").read_text()


def test_the_real_model_bench_times_the_gpt_under_each_engine():
    """A smoke run of pipemare.experiments.bench.real_models (its figures come from a run
    alone on the machine, not from here): the cut GPT, its Sequential twin and torch's own
    pipeline() + Schedule1F1B each train on 2 gloo processes and report a rate."""
    from pipemare.experiments.bench import real_models

    small = ["--steps", "2", "--warmup", "1", "--batch", "8", "--width", "16", "--layers", "2"]
    rates = real_models.main([*small, "--context", "8", "--cut", "1"])
    assert set(rates) == {"pipemare", "pipemare-sequential", "torch-1F1B"}
    assert all(rate > 0 for rate in rates.values())


def test_memory_growth_is_the_slope_per_thousand_steps():
    from pipemare.experiments.bench.memory import growth_per_1000, memory_growth

    # a one-off allocation at the start, then 0.05 MB per step: 50 MB per 1,000 steps
    samples = [(s, 500.0 + 0.05 * s + (20.0 if s == 0 else 0.0)) for s in range(200)]
    assert 45 < growth_per_1000(samples) < 55
    level = [(s, 512.0) for s in range(100)]
    assert growth_per_1000(level) == 0.0 and growth_per_1000(level[:1]) == 0.0
    assert memory_growth([(s, r, None) for s, r in level]) == {"resident_mb_per_1000": 0.0}


def test_the_rotated_cost_bench_writes_its_rows_with_the_command(tmp_path, one_thread):
    """A smoke run of pipemare.experiments.bench.rotated_cost at a tiny width (its figures come
    from a run alone on the machine): every row has both optimisers' steps and the whole
    step's ratio, and the file names the command that wrote it."""
    from pipemare.experiments.bench import rotated_cost

    out = tmp_path / "rotated.json"
    rotated_cost.main(["--widths", "8", "16", "--tokens", "32", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].endswith("--widths 8 16 --tokens 32 --out " + str(out))
    assert [r["width"] for r in record["rows"]] == [8, 16]
    for r in record["rows"]:
        assert r["rotated_step_ms"] > 0 and r["adamw_step_ms"] > 0
        whole = (r["forward_backward_ms"] + r["rotated_step_ms"]) / (
            r["forward_backward_ms"] + r["adamw_step_ms"]
        )
        assert r["step_ratio"] == pytest.approx(whole)
    assert record["machine"]["threads"] == 1
