"""``pipemare study default``: the main job. On 4 devices, with the learning rate you tuned on one,
does pipemare reach your quality sooner than 1F1B? A slice of the user's protocol
(:mod:`~pipemare.experiments.studies.user_protocol`) that answers in about five minutes on two
CPU cores.

What it runs, fixed before any run trains:

- **Tasks** (:data:`RUNS`): a GPT whose stages cost about their rows (``gpt_c64s``, 6 blocks of
  width 128 at context 64) and the small character GPT (``char_gpt@adamw``, 14 blocks of width
  32 at context 16), both trained with AdamW at the rate tuned on one device (gpipe's sweep on
  the 1-3-10 grid, written down here). Each is labelled by its measured cost per row:
  compute-bound where its smallest microbatch costs at most 1.25x per row what its whole batch
  does, as on real models' stages; dispatch-bound otherwise.
- **Layout**: P = 4 stages, each schedule at the N it is compared at: ``pipemare`` and
  uncorrected ``async`` at the strategy's default N, gpipe at the same N, and 1F1B at its fastest
  N among the batch's divisors (1F1B computes gpipe's curve per step; only its pipeline time
  differs). Two seeds each, for the task's step count.

How it runs:

1. **Times**, in this process, alone (nothing trains meanwhile): each configuration's actions
   timed over a short window and replayed through its schedule, as if each stage had a device.
   Stored in ``OUT/step_times.json`` with each task's cost per row (``cost_per_row.json``); a
   rerun into the same directory reuses them. Only the time columns read them.
2. **Runs**: every run trains in this invocation, two at a time (one core each), stored runs
   are never reused.
3. **The answer**: ``results.json``, ``results.md``, the verdict printed in a user's words
   (quality at equal steps against 1F1B, time to 1F1B's quality as a ratio of 1F1B's), one W&B
   run per training run (offline without an API key), and with ``--dashboard`` the page
   ``OUT/dashboard/index.html``.

The full protocol (P = 2, 4, 8, seven tasks, three seeds on the GPT) is
``pipemare user-protocol``; about 90 minutes per task on two cores.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from pipemare.experiments.studies.fair import execute
from pipemare.experiments.studies.grid import Job, load_result
from pipemare.experiments.studies.protocol import TASKS
from pipemare.experiments.studies.user_protocol import (
    gap_text,
    jobs_for,
    markdown,
    measure_cost_per_row,
    measure_times,
    round_ratios,
    task_table,
)

__all__ = [
    "RUNS",
    "STAGES",
    "answer_lines",
    "run_main_job",
    "schedule_series",
    "stored_lines",
    "stored_rows",
]

#: task -> (its one-device rate, the steps of each run): the rate is gpipe's best on the 1-3-10
#: grid at that length, seed 0 (``pipemare user-protocol --tasks T --stages 4 --steps S``;
#: experiments/results/main_job/README.md). Both run 240 steps: the character GPT ran 400 until
#: the job took six minutes on a slow hour of this machine
RUNS: dict[str, tuple[float, int]] = {"gpt_c64s": (1e-3, 240), "char_gpt@adamw": (3e-3, 240)}

#: the stored long-horizon study shown beside the fresh short answer (``horizon.py table``)
HORIZON = Path(__file__).resolve().parents[1] / "results" / "horizon" / "verdict.json"
#: the same study on the same GPT cut between each block's attention and its MLP as well
HALVES = HORIZON.parents[1] / "horizon_halves" / "verdict.json"

#: the layout the main job answers for
STAGES = (4,)

#: seeds per run: two, for a spread
SEEDS = 2

#: each configuration's timed window: steps timed, steps before them, windows (the median)
TIMING = {"steps": 6, "warm": 2, "repeats": 3}


def _cells(runs: dict[str, tuple[float, int]], seeds: int) -> dict[str, dict]:
    return {name: jobs_for(name, lr, seeds, False, n, STAGES) for name, (lr, n) in runs.items()}


def run_main_job(
    out: Path,
    runs: dict[str, tuple[float, int]] | None = None,
    seeds: int = SEEDS,
    workers: int = 2,
    wandb: bool = True,
) -> dict[str, Any]:
    """Time, train and answer (see the module's docstring) into ``out``; returns what
    ``results.json`` holds. ``runs``: task -> (rate, steps), default :data:`RUNS`."""
    runs = dict(RUNS if runs is None else runs)
    for name in runs:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose among {', '.join(sorted(TASKS))}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    names = list(runs)
    rates = {name: lr for name, (lr, _) in runs.items()}
    cells = _cells(runs, seeds)
    plan = {
        "stages": list(STAGES),
        "seeds": seeds,
        "tasks": {
            n: {"rate": lr, "steps": steps, "optimizer": TASKS[n].optimizer}
            for n, (lr, steps) in runs.items()
        },
    }
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    measure_times(out, names, False, stages=STAGES, **TIMING)
    measure_cost_per_row(out, names, stages=STAGES)
    print(f"times: {time.perf_counter() - start:.0f} s ({out / 'step_times.json'})", flush=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # every reported run trains now
    jobs = [j for name in names for js in cells[name].values() for j in js]
    times = json.loads((out / "step_times.json").read_text())
    # the longest runs first (steps × the measured step), so that the workers finish together
    jobs.sort(key=lambda j: -runs[j.task][1] * times[f"{j.task}-1f1b-P{STAGES[0]}-N1"])
    execute(jobs, out, workers, "runs")
    costs = json.loads((out / "cost_per_row.json").read_text())
    results: dict[str, Any] = {
        "tasks": {
            n: task_table(out, n, rates[n], cells[n], times, None, costs.get(n), STAGES)
            for n in names
        },
        "held_out": None,
        "seeds": seeds,
        "stages": list(STAGES),
    }
    rounds_path = out / "step_rounds.json"
    results["step_rounds"] = json.loads(rounds_path.read_text()) if rounds_path.exists() else {}
    results["answer"] = answer_lines(results)
    stored = stored_rows() + stored_rows(HALVES)
    results["stored"] = [row["line"] for row in stored]
    results["stored_rows"] = [{k: v for k, v in row.items() if k != "line"} for row in stored]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    listed = "".join(f"- {line}\n" for line in results["stored"])
    (out / "results.md").write_text(
        "\n".join(f"- {line}" for line in results["answer"])
        + "\n\n"
        + (f"Stored, not run now:\n\n{listed}\n" if listed else "")
        + markdown(results)
    )
    if wandb:
        log_to_wandb(out, results, cells)
    print(f"done in {time.perf_counter() - start:.0f} s: {out / 'results.md'}", flush=True)
    for line in results["answer"]:
        print(line, flush=True)
    if results["stored"]:
        print("Stored, not run now:", flush=True)
        for line in results["stored"]:
            print(f"  {line}", flush=True)
    return results


def stored_lines(path: Path = HORIZON) -> list[str]:
    """The stored long-horizon study beside the fresh answer, each line labelled with its
    length, its rate and how it was produced: per P, the default pipemare (N = P) and
    uncorrected async against 1F1B at the longest horizon measured, at the task's rate and at
    any rate re-tuned on one device where pipemare ran at it; at the task's rate, pipemare's
    step with the spread of the timing sittings' own ratios.
    Nothing if the file is absent (an install without the repository's results)."""
    return [row["line"] for row in stored_rows(path)]


def stored_rows(path: Path = HORIZON) -> list[dict[str, Any]]:
    """:func:`stored_lines`' cells as rows (the dashboard's table), each with its ``line``:
    the study's task, steps, rate and P, pipemare's and uncorrected async's cells (``gap``,
    ``spread``, ``seeds``, ``time_vs_1f1b``), pipemare's step against 1F1B's with the range of
    the sittings' own ratios where they were read, and the file and command behind it."""
    if not path.exists():
        return []
    study = json.loads(path.read_text())
    cells = [c for c in study["cells"] if c["schedule"] != "gpipe" and c["N"] == c["P"]]
    if not cells:
        return []
    longest = max(c["steps"] for c in cells)
    source = f"{path.relative_to(path.parents[3])}" if len(path.parents) > 3 else str(path)
    command = "python experiments/studies/horizon.py table"
    if study["task"] != "gpt_c64s":  # the study's other cut
        command += f" --task {study['task']}"
    rows = []
    for lr in sorted({c["lr"] for c in cells if c["steps"] == longest}):
        at = {(c["schedule"], c["P"]): c for c in cells if c["steps"] == longest and c["lr"] == lr}
        for p in sorted({p for s, p in at if s == "pipemare"}):
            pm, asy = at[("pipemare", p)], at.get(("async", p))
            rate = "the task's rate"
            if lr != study["task_rate"]:
                rate = "a rate of the one-device re-tune"
            text = (
                f"{study['task']}, {longest:,} steps "
                f"({longest / study['main_job_steps']:.0f}x this job's {study['main_job_steps']}),"
                f" rate {lr:g} ({rate}), P = {p}, every stage simulated in one process "
                f"({source}, `{command}`): pipemare "
                f"(N = {p}) ends {_stored_cell(pm)}"
            )
            ratios = study.get("sitting_step_ratios", {}).get(f"P{p}")
            step = None
            if lr == study["task_rate"] and ratios and pm.get("step_vs_1f1b") is not None:
                step = (pm["step_vs_1f1b"], min(ratios["each"]), max(ratios["each"]))
                text += (
                    f" (its step {step[0]:.2f}x 1F1B's: each of {len(ratios['each'])}"
                    f" timing sittings read against its own 1F1B, the median; one sitting's "
                    f"ratio ranged {step[1]:.2f}-{step[2]:.2f}x)"
                )
            if asy is not None:
                text += f"; uncorrected async (N = {p}): {_stored_cell(asy)}"
            rows.append(
                {
                    "task": study["task"],
                    "steps": longest,
                    "rate": lr,
                    "task_rate": lr == study["task_rate"],
                    "P": p,
                    "pipemare": _stored_numbers(pm),
                    "async": _stored_numbers(asy) if asy is not None else None,
                    "step": step,
                    "source": source,
                    "command": command,
                    "line": text + ".",
                }
            )
    return rows


def _stored_numbers(c: dict[str, Any]) -> dict[str, Any]:
    """A stored cell's figures as the dashboard shows them: the gap at equal steps, its
    half-range over seeds (both fractions of 1F1B's), the seeds, whether it reaches 1F1B's
    quality within the run and in what share of 1F1B's time (None: not timed, or never)."""
    return {
        "gap": c["gap"],
        "spread": c["spread"] / (c["mean"] / (1 + c["gap"])),
        "seeds": len(c["seeds"]),
        "reaches": c.get("reach") is not None,
        "time_vs_1f1b": c.get("time_vs_1f1b"),
    }


def _stored_cell(c: dict[str, Any]) -> str:
    """A stored cell in words, from its :func:`_stored_numbers`."""
    n = _stored_numbers(c)
    seeds = n["seeds"]
    quality = (
        f"{100 * n['gap']:+.1f}% (± {100 * n['spread']:.1f}% "
        f"over {seeds} seed{'s' if seeds > 1 else ''}) against 1F1B at equal steps"
    )
    if n["time_vs_1f1b"] is not None:
        return f"{quality}, and reaches 1F1B's quality in {n['time_vs_1f1b']:.2f}x 1F1B's time"
    if not n["reaches"]:
        return f"{quality}, and does not reach 1F1B's quality within the run"
    return f"{quality} (its step time not measured)"


def _reach(row: dict[str, Any], base: dict[str, Any], rounds: list[float] | None = None) -> str:
    """Whether ``row`` reaches 1F1B's quality and in what share of its time, or what its step
    costs; with ``rounds`` (its step over 1F1B's in each timing round), their range."""
    spread = ""
    if rounds and len(rounds) > 1:
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}x in the {len(rounds)} timing rounds"
    ratio = row["time_vs_1f1b"]
    if math.isfinite(ratio):
        each = f" (its step over 1F1B's: {spread})" if spread else ""
        return f"reaches 1F1B's quality in {ratio:.2f}x 1F1B's time{each}"
    step = row["step_time_s"] / base["step_time_s"]
    each = f"; {spread}" if spread else ""
    return f"does not reach 1F1B's quality within the run (a step costs {step:.2f}x 1F1B's{each})"


def answer_lines(results: dict[str, Any]) -> list[str]:
    """The verdict in a user's words: per task and P, pipemare's quality at equal steps against
    1F1B's and its time to 1F1B's quality as a ratio of 1F1B's, with async and gpipe beside."""
    lines = []
    rounds = results.get("step_rounds") or {}
    for name, task in results["tasks"].items():
        higher = task["higher_is_better"]
        costs = task.get("cost_per_row") or {}
        per_row = ", ".join(
            f"{1e3 * s:.2f} ms a row at {rows} rows"
            for rows, s in sorted(costs.items(), key=lambda kv: int(kv[0]))
        )
        label = f"{task.get('regime') or 'regime not measured'}{': ' + per_row if per_row else ''}"
        for p in task["stages"]:
            series = {s: (n, row) for s, n, row, _ in schedule_series(task, p)}
            if not {"pipemare", "async"} <= set(series):
                continue
            n_base, base = series["1f1b"]
            n_pm, pm = series["pipemare"]
            n_gp, gp = series["gpipe"]
            asy = series["async"][1]
            spread = 100 * pm["spread"] / (1 if higher else base["final"])
            unit = " points" if higher else "%"
            mine = round_ratios(
                rounds, f"{name}-pipemare-P{p}-N{n_pm}", f"{name}-1f1b-P{p}-N{n_base}"
            )
            lines.append(
                f"{name} ({label}), {task['steps']} steps at rate {task['rate']:g} (one "
                f"device's), P = {p}: pipemare (N = {n_pm}) ends "
                f"{gap_text(pm['final'], base['final'], higher)} (± {spread:.1f}{unit} over seeds) "
                f"against 1F1B "
                f"(N = {n_base}) at equal steps and {_reach(pm, base, mine)}; uncorrected async "
                f"(N = {n_pm}): {gap_text(asy['final'], base['final'], higher)}, "
                f"{_reach(asy, base)}; "
                f"gpipe (N = {n_gp}): {_reach(gp, base)}."
            )
    return lines


def schedule_series(task: dict[str, Any], p: str) -> list[tuple[str, int, dict[str, Any], tuple]]:
    """(schedule, N, its row, the cell whose runs draw it) of each schedule at ``p`` stages in a
    task of ``results.json``: 1F1B draws gpipe's runs (the same curve per step) at its own step
    time."""
    stage = task["stages"][p]
    base = stage["1f1b"]
    out = [("1f1b", base["N"], base, ("gpipe", 2, 1))]
    for row in stage["rows"]:
        if row["schedule"].startswith("gpipe"):
            out.append(("gpipe", row["N"], row, ("gpipe", 2, 1)))
        elif row.get("default_n"):
            out.append((row["schedule"], row["N"], row, (row["schedule"], int(p), row["N"])))
    return out


def log_to_wandb(out: Path, results: dict[str, Any], cells: dict[str, dict]) -> None:
    """One W&B run per training run, grouped ``default`` (offline without an API key): the
    validation metric against steps and against pipeline time, the setup and the verdict's
    figures in its summary. 1F1B gets gpipe's curves with its own pipeline time."""
    import os

    import wandb

    from pipemare.callbacks.wandb import has_api_key

    mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
    if mode == "disabled":
        return
    for name, task in results["tasks"].items():
        for p in task["stages"]:
            for schedule, n, row, key in schedule_series(task, p):
                for job in cells[name][key]:
                    _wandb_run(
                        wandb, mode, out, name, task["metric"], schedule, int(p), n, row, job
                    )


def _wandb_run(
    wandb: Any,
    mode: str,
    out: Path,
    task: str,
    metric: str,
    schedule: str,
    p: int,
    n: int,
    row: dict[str, Any],
    job: Job,
) -> None:
    run = load_result(out, job)
    step_s = row["step_time_s"]
    experiment = wandb.init(
        project="pipemare",
        group="default",
        job_type=task,
        name=f"{task}-{schedule}-P{p}-N{n}-s{job.seed}",
        dir=str(out),
        mode=mode,
        reinit="create_new",
        config={
            "task": task,
            "schedule": schedule,
            "stages": p,
            "microbatches": n,
            "lr": job.lr,
            "seed": job.seed,
            "step_time_s": step_s,
        },
        settings=wandb.Settings(silent=True),
    )
    experiment.define_metric("pipeline_time_s")
    experiment.define_metric(metric, step_metric="pipeline_time_s")
    for step, value in zip(run.steps, run.metric, strict=True):
        experiment.log({metric: value, "pipeline_time_s": step * step_s}, step=step)
    experiment.summary.update(
        {
            "final": row["final"],
            "steps_to_target": row["steps_to_target"],
            "time_vs_1f1b": row["time_vs_1f1b"],
        }
    )
    experiment.finish()
