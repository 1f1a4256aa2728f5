"""``pipemare user-protocol``: the user's protocol. One rate per task, the one tuned on one device,
used by every schedule; P = 2, 4, 8 at the N the strategy picks by default; 1F1B at its fastest
N as the baseline; quality at equal steps and pipeline time to 1F1B's final quality.

A user comes with a model and a learning rate tuned on one device and asks which schedule on P
devices reaches that quality soonest. Per task:

1. **The rate.** gpipe (which computes what one device computes for the minibatch) is swept over
   the 1-3-10 grid (seed 0; a best rate at the grid's edge gets its neighbour beyond, twice at
   most); the rate with the best validation metric is the task's, a tie going to the lower rate.
   Every schedule runs at it.
2. **The runs.** gpipe, and at each P the asynchronous schedules (``pipemare``, uncorrected
   ``async``) at the default N (:func:`pipemare.planner.decide.auto_microbatches`,
   ``N_auto``) and, with ``--all-n``, at N = 1 and N = P too; each with ``--seeds`` seeds.
3. **The baseline.** 1F1B computes gpipe's loss curve per step; only its pipeline time differs.
   Its step time is measured at every N dividing the batch and the fastest, N*, is 1F1B's.
4. **Pipeline time.** Each configuration's step time comes from its per-action times measured
   once, alone (``--phase times``, nothing else on the machine), replayed through its schedule
   (:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`: a task's
   configurations' windows taken in turn, so the machine's drift falls on all alike); no clock
   is read while a run trains. Time to quality = steps until the validation metric first comes
   within 1% (0.5 point of accuracy) of 1F1B's final quality, times the step time.
5. **Equal pipeline time** (``--phase equal-time``, or ``--equal-time`` with ``all``): pipemare
   at the default N trained again for as many steps as 1F1B's pipeline time over the task's
   run allows it (its rate schedule stretched over them), so a schedule that steps faster gets
   its extra steps; its final quality and time to 1F1B's quality are reported beside.
6. **Regime.** Each task is labelled by its whole model's forward and backward per row at the
   microbatch sizes its layouts run (``cost_per_row.json``, measured with the step times):
   compute-bound where the smallest costs at most 1.25× per row what the whole batch does.
7. **Verdicts** (issue 40's bar), per cell at the default N: quality at equal steps within 2% of
   1F1B's (1 point); time to quality at most 0.8 of 1F1B's, or, where 1F1B's own bubble bound
   ``1 - (P-1)/(N*+P-1)`` is above 0.75, at most that bound + 0.05; never below ``async`` by
   more than the seed spread (half the range of the seeds).

The held-out task (:data:`HELD_OUT`) decides no default; it is reported apart. Outputs in
``OUT``: ``runs/*.json`` (shared keys with ``pipemare protocol``: a stored run is reused when it
was set up as the job is today), ``step_times.json``, ``rates.json``, ``results.json``,
``results.md`` and ``loss_vs_time_*.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pipemare.experiments._commands import add_tasks_argument, command_parser
from pipemare.experiments.studies.fair import best_rate, execute, next_rate
from pipemare.experiments.studies.fair_report import first_reach, plateau, spread
from pipemare.experiments.studies.grid import Job, load_result
from pipemare.experiments.studies.protocol import TASKS, RunResult, Task

__all__ = [
    "HELD_OUT",
    "STAGES",
    "USER_TASKS",
    "equal_time_jobs",
    "gap_text",
    "measure_cost_per_row",
    "one_f_one_b_ns",
    "regime",
    "round_ratios",
    "run_compare",
    "verdict",
]

#: the tasks of the user's protocol: the GPT with AdamW and with Muon + AdamW, the LSTM-free
#: char LM, MNIST, the digits, the plain deep network with Adam and with SGD momentum
USER_TASKS = (
    "char_gpt@adamw",
    "char_gpt@muon",
    "char_lm",
    "mnist",
    "digits",
    "plain",
    "plain@sgdm",
)

#: decides no default (not used by any decision of :mod:`pipemare.optim.settings`)
HELD_OUT = "digits"

#: the layouts users get
STAGES = (2, 4, 8)

#: within this of 1F1B's final quality counts as reached (relative for a loss, points for
#: accuracy)
REACH = {"loss": 0.01, "acc": 0.005}

#: the bar of quality at equal steps (relative for a loss, points for accuracy)
QUALITY = {"loss": 0.02, "acc": 0.01}


def _rates(task: Task) -> tuple[float, ...]:
    """The rates the one-device sweep starts from: the task's, one step up the grid too."""
    return tuple(sorted({*task.lrs, next_rate(max(task.lrs), up=True)}))


def auto_n(task: Task, stages: int) -> int:
    """The N the strategy picks by default for ``task``'s batch at P = ``stages``."""
    from pipemare.planner.decide import auto_microbatches

    return auto_microbatches("pipemare", stages, rows=task.batch)[0]


def one_f_one_b_ns(task: Task, stages: int) -> list[int]:
    """The N 1F1B is timed at: every divisor of the batch."""
    return [n for n in range(1, task.batch + 1) if task.batch % n == 0]


def _ns(task: Task, stages: int, all_n: bool) -> list[int]:
    return sorted({auto_n(task, stages), 1, stages} if all_n else {auto_n(task, stages)})


def tune_rate(out: Path, name: str, workers: int, steps: int | None) -> float:
    """The one-device rate of task ``name``: gpipe's sweep (see the module's docstring)."""
    task = TASKS[name]
    jobs = [Job(name, "gpipe", 2, 1, lr, 0, steps) for lr in _rates(task)]
    execute(jobs, out, workers, f"{name}: one-device rate")
    for _ in range(2):
        rates = sorted(j.lr for j in jobs)
        best = best_rate(out, task, jobs)
        if best not in (rates[0], rates[-1]):
            break
        job = Job(name, "gpipe", 2, 1, next_rate(best, up=best == rates[-1]), 0, steps)
        jobs.append(job)
        execute([job], out, workers, f"{name}: rate beyond the sweep's edge")
    return best_rate(out, task, jobs)


def jobs_for(
    name: str,
    rate: float,
    seeds: int,
    all_n: bool,
    steps: int | None,
    stages: tuple[int, ...] = STAGES,
) -> dict[tuple[str, int, int], list[Job]]:
    """(schedule, P, N) -> the seeded runs of task ``name`` at ``rate``, at each P of
    ``stages``."""
    task = TASKS[name]
    cells = {("gpipe", 2, 1): [Job(name, "gpipe", 2, 1, rate, s, steps) for s in range(seeds)]}
    for p in stages:
        for n in _ns(task, p, all_n):
            for v in ("async", "pipemare"):
                cells[(v, p, n)] = [Job(name, v, p, n, rate, s, steps) for s in range(seeds)]
    return cells


def _time_keys(name: str, all_n: bool, stages: tuple[int, ...]) -> list[tuple[str, int, int]]:
    task = TASKS[name]
    keys = []
    for p in stages:
        keys += [("1f1b", p, n) for n in one_f_one_b_ns(task, p)]
        keys.append(("gpipe", p, auto_n(task, p)))
        keys += [(v, p, n) for n in _ns(task, p, all_n) for v in ("async", "pipemare")]
    return keys


def measure_times(
    out: Path,
    names: list[str],
    all_n: bool,
    steps: int = 12,
    repeats: int = 3,
    stages: tuple[int, ...] = STAGES,
    warm: int = 8,
) -> dict[str, float]:
    """Pipeline seconds per step of every configuration the tables need at each P of
    ``stages`` (run it alone on the machine): the median of ``repeats`` windows of ``steps``
    steps after ``warm``, a task's configurations' windows taken in turn
    (:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`). Three, so that one
    disturbed window is outvoted; the median of two is their mean, and one disturbed window
    moved a configuration's time by up to 2.5x between two sittings on this two-core machine.
    Each window's own time is kept beside them, in ``step_rounds.json`` (:func:`round_ratios`)."""
    import torch
    from tqdm import tqdm

    from pipemare.experiments.studies.protocol import interleaved_step_times

    path, rounds_path = out / "step_times.json", out / "step_rounds.json"
    times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    kept: dict[str, list[float]] = (
        json.loads(rounds_path.read_text()) if rounds_path.exists() else {}
    )
    todo: dict[str, list[tuple[str, int, int]]] = {}
    for t in names:
        for v, p, n in _time_keys(t, all_n, stages):
            if f"{t}-{v}-P{p}-N{n}" not in times:
                todo.setdefault(t, []).append((v, p, n))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per stage's work, as the runs train
    try:
        for t, keys in tqdm(todo.items(), desc="pipeline time per step", unit="task"):
            rounds: dict[tuple[str, int, int], list[float]] = {}
            found = interleaved_step_times(
                TASKS[t], keys, None, steps, warm, repeats, rounds=rounds
            )
            for (v, p, n), by_link in found.items():
                times[f"{t}-{v}-P{p}-N{n}"] = by_link["free"]
                kept[f"{t}-{v}-P{p}-N{n}"] = rounds[(v, p, n)]
            path.write_text(json.dumps(times, indent=1, sort_keys=True))
            rounds_path.write_text(json.dumps(kept, indent=1, sort_keys=True))
    finally:
        torch.set_num_threads(threads)
    return times


def round_ratios(rounds: dict[str, list[float]], key: str, base: str) -> list[float]:
    """``key``'s step over ``base``'s in each timing round that timed both (the windows of one
    round ran within the same minute, so a slower minute falls on both); empty where either was
    not kept.

    Example:
        >>> round_ratios({"a": [2.0, 3.0], "b": [4.0, 4.0]}, "a", "b")
        [0.5, 0.75]
    """
    mine, theirs = rounds.get(key, []), rounds.get(base, [])
    return [a / b for a, b in zip(mine, theirs, strict=False) if b > 0 and math.isfinite(a / b)]


def equal_time_jobs(
    name: str,
    rate: float,
    seeds: int,
    times: dict[str, float],
    steps: int | None,
    stages: tuple[int, ...] = STAGES,
) -> dict[int, list[Job]]:
    """P -> pipemare's runs at the default N given 1F1B's pipeline time (at N*) over the
    task's run: ``steps × (1F1B's step / pipemare's step)`` steps, rounded, so a schedule that
    steps faster gets its extra steps (the rate schedule stretched over them, as a user with
    that time budget would set it). Empty where a step time is missing."""
    task = TASKS[name]
    length = steps or task.steps
    out: dict[int, list[Job]] = {}
    for p in stages:
        per = {n: times.get(f"{name}-1f1b-P{p}-N{n}", math.nan) for n in one_f_one_b_ns(task, p)}
        n_star = min(per, key=lambda n: (per[n], n))
        own = times.get(f"{name}-pipemare-P{p}-N{auto_n(task, p)}", math.nan)
        if not (math.isfinite(own) and math.isfinite(per[n_star])):
            continue
        budget = max(1, round(length * per[n_star] / own))
        n = auto_n(task, p)
        out[p] = [
            Job(name, "pipemare", p, n, rate, s, budget, suffix=f"-time{budget}")
            for s in range(seeds)
        ]
    return out


def _equal_time_row(
    out: Path, jobs: list[Job], target: float, higher: bool, step_s: float, base_time: float
) -> dict[str, Any]:
    row = _seeded(out, jobs, target, higher, step_s, base_time)
    return {"schedule": "pipemare at 1F1B's time", "N": jobs[0].microbatches, **row}


def _seeded(
    out: Path, jobs: list[Job], target: float, higher: bool, step_s: float, base_time: float
) -> dict[str, Any]:
    """What a cell's seeded runs reached: their final quality (mean, spread, each), their mean
    steps to ``target``, and that time against 1F1B's ``base_time``."""
    runs = [load_result(out, j) for j in jobs]
    finals = [_final(r) for r in runs]
    steps_to = statistics.fmean(first_reach(r, target, higher) for r in runs)
    return {
        "steps": jobs[0].steps,
        "final": statistics.fmean(finals),
        "spread": spread(finals),
        "seeds": finals,
        "steps_to_target": steps_to,
        "step_time_s": step_s,
        "time_to_target_s": steps_to * step_s,
        "time_vs_1f1b": steps_to * step_s / base_time,
        "diverged": sum(r.diverged for r in runs),
    }


def regime(cost_per_row: dict[int, float]) -> str:
    """A task's regime from its whole model's forward and backward per row at each microbatch
    size its layouts run: ``"compute-bound"`` where the smallest microbatch costs at most 1.25×
    per row what the whole batch costs (N = P then costs about what N = 1 does), else
    ``"dispatch-bound"``."""
    rows = sorted(cost_per_row)
    return (
        "compute-bound"
        if cost_per_row[rows[0]] <= 1.25 * cost_per_row[rows[-1]]
        else ("dispatch-bound")
    )


def measure_cost_per_row(
    out: Path, names: list[str], repeats: int = 15, stages: tuple[int, ...] = STAGES
) -> dict[str, dict]:
    """Seconds per row of each task's whole model, forward and backward, one thread, at each
    microbatch size its default layouts run (the batch / N for N = 1 and the default N at each
    P of ``stages``): the median of ``repeats``, the sizes taken in turn (a slower minute falls
    on every size alike). Run it alone on the machine. A task measured before, at other sizes,
    is measured again.

    ``gpt_c64s``'s row at 4 rows over its row at 16, in trials in a row on 2026-12-02: one size
    after another as the median of 5, 1.03-1.33x in six trials, either side of
    :func:`regime`'s 1.25; in turn, the median of 15, 1.10-1.20x in nine; in turn, the fastest
    of 15, 1.10-1.30x in nine (and 1.31x inside one run of the main job)."""
    import time

    import torch

    path = out / "cost_per_row.json"
    costs: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in names:
            task = TASKS[name]
            sizes = sorted({task.batch, *(task.batch // auto_n(task, p) for p in stages)})
            if sorted(int(r) for r in costs.get(name, {})) == sizes:
                continue
            torch.manual_seed(0)
            model = task.build()
            x, y, _, _ = task.data()
            seconds: dict[int, list[float]] = {rows: [] for rows in sizes}
            for r in range(repeats + 1):  # the first round warms up and is not counted
                for rows in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                    start = time.perf_counter()
                    task.loss(model(x[:rows]), y[:rows]).backward()
                    seconds[rows].append(time.perf_counter() - start)
            costs[name] = {
                str(rows): statistics.median(s[1:]) / rows for rows, s in seconds.items()
            }
            path.write_text(json.dumps(costs, indent=1, sort_keys=True))
    finally:
        torch.set_num_threads(threads)
    return costs


def _final(run: RunResult) -> float:
    return run.metric[-1] if run.metric and math.isfinite(run.metric[-1]) else math.nan


def verdict(row: dict[str, Any], baseline: dict[str, Any], higher: bool) -> dict[str, bool]:
    """Issue 40's bar for one cell ``row`` against 1F1B's row ``baseline`` (the same P) and
    ``row["async"]``, uncorrected async's quality at the same P and N."""
    ref = baseline["final"]
    if higher:
        quality = row["final"] >= ref - QUALITY["acc"]
        not_below_async = row["final"] >= row["async"] - row["async_spread"] - row["spread"]
    else:
        quality = row["final"] <= ref * (1 + QUALITY["loss"])
        not_below_async = row["final"] <= row["async"] + row["async_spread"] + row["spread"]
    ratio = row["time_vs_1f1b"]
    bound = baseline["bubble_bound"]
    sooner = ratio <= 0.8 or (bound > 0.75 and ratio <= bound + 0.05)
    return {"quality": quality, "sooner": sooner, "not_below_async": not_below_async}


def task_table(
    out: Path,
    name: str,
    rate: float,
    cells: dict[tuple[str, int, int], list[Job]],
    times: dict,
    equal_time: dict[int, list[Job]] | None = None,
    cost_per_row: dict[str, float] | None = None,
    stages: tuple[int, ...] = STAGES,
) -> dict[str, Any]:
    """One task's table: per P of ``stages``, 1F1B at N*, gpipe, the asynchronous cells, and
    pipemare given 1F1B's pipeline time where it was run (:func:`equal_time_jobs`)."""
    task = TASKS[name]
    higher = task.higher_is_better
    sync = [load_result(out, j) for j in cells[("gpipe", 2, 1)]]
    final = statistics.fmean(_final(r) for r in sync)
    target = final - REACH["acc"] if higher else final * (1 + REACH["loss"])
    sync_steps = statistics.fmean(first_reach(r, target, higher) for r in sync)
    result: dict[str, Any] = {
        "task": name,
        "held_out": name == HELD_OUT,
        "metric": "val_acc" if higher else "val_loss",
        "higher_is_better": higher,
        "rate": rate,
        "steps": sync[0].steps[-1],
        "final_1f1b": final,
        "target": target,
        "plateau_gain": plateau(sync, higher),
        "cost_per_row": cost_per_row,
        "regime": regime({int(k): v for k, v in cost_per_row.items()}) if cost_per_row else None,
        "stages": {},
    }
    for p in stages:
        ns = one_f_one_b_ns(task, p)
        per = {n: times.get(f"{name}-1f1b-P{p}-N{n}", math.nan) for n in ns}
        n_star = min(per, key=lambda n: (per[n], n))
        base_time = sync_steps * per[n_star]
        baseline = {
            "schedule": "1f1b",
            "N": n_star,
            "final": final,
            "spread": spread([_final(r) for r in sync]),
            "steps_to_target": sync_steps,
            "step_time_s": per[n_star],
            "time_to_target_s": base_time,
            "time_vs_1f1b": 1.0,
            "bubble_bound": 1 - (p - 1) / (n_star + p - 1),
            "step_times_by_n": per,
        }
        n_gpipe = auto_n(task, p)
        gpipe_step = times.get(f"{name}-gpipe-P{p}-N{n_gpipe}", math.nan)
        rows = [
            {
                "schedule": "gpipe (pipemare's N)",
                "N": n_gpipe,
                "final": final,
                "spread": baseline["spread"],
                "steps_to_target": sync_steps,
                "step_time_s": gpipe_step,
                "time_to_target_s": sync_steps * gpipe_step,
                "time_vs_1f1b": sync_steps * gpipe_step / base_time,
            }
        ]
        for (v, pp, n), jobs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0])):
            if pp != p or v == "gpipe":
                continue
            step_s = times.get(f"{name}-{v}-P{p}-N{n}", math.nan)
            row = _seeded(out, jobs, target, higher, step_s, base_time)
            rows.append({"schedule": v, "N": n, "default_n": n == auto_n(task, p), **row})
        if (
            equal_time
            and p in equal_time
            and all((out / "runs" / f"{j.key}.json").exists() for j in equal_time[p])
        ):
            step_s = times.get(f"{name}-pipemare-P{p}-N{equal_time[p][0].microbatches}", math.nan)
            rows.append(_equal_time_row(out, equal_time[p], target, higher, step_s, base_time))
        by = {(r["schedule"], r["N"]): r for r in rows}
        for r in rows:
            if r["schedule"] == "pipemare":
                a = by[("async", r["N"])]
                r["async"], r["async_spread"] = a["final"], a["spread"]
                r["verdict"] = verdict(r, baseline, higher)
        result["stages"][str(p)] = {"1f1b": baseline, "rows": rows}
    return result


def _quality(value: float, spread: float, higher: bool) -> str:
    return f"{value:.3f} ± {spread:.3f}" if math.isfinite(value) else "—"


def gap_text(value: float, ref: float, higher: bool) -> str:
    """``value`` against ``ref``: points for an accuracy, percent for a loss; "—" if not finite."""
    if not math.isfinite(value):
        return "—"
    if higher:
        return f"{100 * (value - ref):+.1f} pt"
    return f"{100 * (value / ref - 1):+.1f}%"


def _ratio(x: float) -> str:
    return "never" if not math.isfinite(x) else f"{x:.2f}"


def _stages(results: dict[str, Any]) -> tuple[int, ...]:
    """The P a ``results.json`` holds."""
    return tuple(int(p) for p in next(iter(results["tasks"].values()))["stages"])


def markdown(results: dict[str, Any]) -> str:
    """The tables of ``results.json``: the verdict summary first, then one table per task."""
    stages = _stages(results)
    lines = [
        "# The user's protocol",
        "",
        "Generated by `pipemare user-protocol` (experiments/studies/user_protocol.py). One "
        "rate per task, tuned on one device (gpipe's sweep), for every schedule. Quality: the "
        "final validation metric at equal steps, mean ± half-range over seeds. Time: pipeline time "
        "(per-action times measured once, alone, replayed) to come within 1% (0.5 point) of "
        "1F1B's final quality, as a ratio of 1F1B's at its fastest N (N*); `never`: not within "
        "the run. Verdicts at the default N: Q quality within 2% (1 point) of 1F1B's; T sooner "
        "(ratio ≤ 0.8, or ≤ 1F1B's bubble bound + 0.05 where that bound is above 0.75); A not "
        "below async beyond the seed spread.",
        "",
        "## Verdicts at the default N",
        "",
        "| task | " + " | ".join(f"P = {p}" for p in stages) + " |",
        "|---|" + "---|" * len(stages),
    ]
    for name, task in results["tasks"].items():
        cells = []
        for p in stages:
            st = task["stages"][str(p)]
            row = next(
                (r for r in st["rows"] if r["schedule"] == "pipemare" and r.get("default_n")),
                None,
            )
            if row is None:
                cells.append("—")
                continue
            v = row["verdict"]
            marks = "".join(k if v[key] else "·" for k, key in zip("QTA", v, strict=True))
            gap = gap_text(row["final"], task["final_1f1b"], task["higher_is_better"])
            cells.append(f"{marks} N={row['N']}: {gap}, time {_ratio(row['time_vs_1f1b'])}")
        label = f"{name} (held out)" if task["held_out"] else name
        if task.get("regime"):
            label += f", {task['regime']}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, task in results["tasks"].items():
        higher = task["higher_is_better"]
        lines += [
            "",
            f"## {name}{' (held out: decides no default)' if task['held_out'] else ''}",
            "",
            f"{task['metric']}, rate {task['rate']:g} (tuned on one device), {task['steps']} "
            f"steps; 1F1B's final quality {task['final_1f1b']:.3f}, target {task['target']:.3f}; "
            f"the synchronous run's metric moved {task['plateau_gain']:.4f} over its last "
            "quarter."
            + (
                f" {task['regime'].capitalize()}: the whole model's forward and backward per "
                "row, one thread, at the microbatch sizes run: "
                + ", ".join(
                    f"{rows} rows {1e3 * s:.2f} ms"
                    for rows, s in sorted(task["cost_per_row"].items(), key=lambda kv: -int(kv[0]))
                )
                + "."
                if task.get("regime")
                else ""
            ),
            "",
            "| P | schedule | N | quality | vs 1F1B | steps to target | ms/step | "
            "time to target vs 1F1B | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in stages:
            st = task["stages"][str(p)]
            b = st["1f1b"]
            lines.append(
                f"| {p} | 1f1b (N* by time) | {b['N']} | "
                f"{_quality(b['final'], b['spread'], higher)} | | "
                f"{b['steps_to_target']:.0f} | {1e3 * b['step_time_s']:.2f} | 1.00 "
                f"(bubble bound {b['bubble_bound']:.2f}) | |"
            )
            for r in st["rows"]:
                v = r.get("verdict")
                mark = "" if v is None else " ".join(k for k, ok in v.items() if not ok) or "all"
                mark = "" if v is None else ("meets" if mark == "all" else f"misses {mark}")
                steps = r["steps_to_target"]
                name_shown = r["schedule"] + (" (default N)" if r.get("default_n") else "")
                if r.get("steps") is not None and r["schedule"].endswith("1F1B's time"):
                    name_shown += f", {r['steps']} steps"
                lines.append(
                    f"| {p} | {name_shown} | "
                    f"{r['N']} | {_quality(r['final'], r['spread'], higher)} | "
                    f"{gap_text(r['final'], task['final_1f1b'], higher)} | "
                    f"{'never' if not math.isfinite(steps) else f'{steps:.0f}'} | "
                    f"{1e3 * r['step_time_s']:.2f} | {_ratio(r['time_vs_1f1b'])} | {mark} |"
                )
    return "\n".join(lines) + "\n"


def plot_against_time(
    out: Path,
    results: dict[str, Any],
    cells: dict[str, dict],
    name: str,
    equal_time: dict[int, list[Job]] | None = None,
) -> Path | None:
    """Validation metric against pipeline time, pipemare (default N) against 1F1B (N*), per P,
    for task ``name``, with pipemare given 1F1B's pipeline time (dashed) where it was run:
    ``loss_vs_time_NAME.png``."""
    if name not in results["tasks"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = results["tasks"][name]
    stages = _stages(results)
    fig, axes = plt.subplots(
        1, len(stages), figsize=(4.2 * len(stages), 3.4), sharey=True, squeeze=False
    )
    for ax, p in zip(axes[0], stages, strict=True):
        st = task["stages"][str(p)]
        b = st["1f1b"]
        series = [("1f1b", b["N"], ("gpipe", 2, 1), b["step_time_s"], "#1f77b4")]
        for r in st["rows"]:
            if r.get("default_n"):
                color = "#2ca02c" if r["schedule"] == "pipemare" else "#ff7f0e"
                series.append(
                    (r["schedule"], r["N"], (r["schedule"], p, r["N"]), r["step_time_s"], color)
                )
        for label, n, key, step_s, color in series:
            for i, job in enumerate(cells[name][key]):
                run = load_result(out, job)
                x = [s * step_s for s in run.steps]
                ax.plot(
                    x,
                    run.metric,
                    color=color,
                    alpha=0.8,
                    label=f"{label} N={n}" if i == 0 else None,
                )
        for i, job in enumerate((equal_time or {}).get(p, [])):
            if not (out / "runs" / f"{job.key}.json").exists():
                continue
            run = load_result(out, job)
            step_s = next(r["step_time_s"] for r in st["rows"] if r["schedule"] == "pipemare")
            ax.plot(
                [s * step_s for s in run.steps],
                run.metric,
                color="#2ca02c",
                ls="--",
                alpha=0.8,
                label=f"pipemare N={job.microbatches}, {job.steps} steps" if i == 0 else None,
            )
        ax.axhline(task["target"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"P = {p}")
        ax.set_xlabel("pipeline time (s)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(task["metric"])
    fig.suptitle(f"{name}: validation against pipeline time (rate {task['rate']:g}, one device's)")
    fig.tight_layout()
    path = out / f"loss_vs_time_{name.replace('@', '_')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_compare(
    out: Path,
    names: list[str],
    seeds: int = 2,
    workers: int = 2,
    steps: int | None = None,
    all_n: bool = False,
    phase: str = "all",
    equal_time: bool = False,
    stages: tuple[int, ...] = STAGES,
) -> dict[str, Any]:
    """Tune, train, time and tabulate (see the module's docstring) at each P of ``stages``;
    returns ``results.json``.

    ``phase``: ``"runs"`` trains only (it may share the machine); ``"times"`` measures the step
    times and each task's cost per row only (alone on the machine); ``"equal-time"`` trains
    pipemare given 1F1B's pipeline time (:func:`equal_time_jobs`; needs the times);
    ``"table"`` tabulates what is stored; ``"all"`` all of them (``equal_time``: with
    ``"equal-time"``'s runs).
    """
    out.mkdir(parents=True, exist_ok=True)
    rates_path = out / "rates.json"
    rates: dict[str, float] = json.loads(rates_path.read_text()) if rates_path.exists() else {}
    if phase == "times":
        measure_times(out, names, all_n, stages=stages)
        measure_cost_per_row(out, names, stages=stages)
        return {}
    cells: dict[str, dict] = {}
    for name in names:
        if name not in rates:
            rates[name] = tune_rate(out, name, workers, steps)
            rates_path.write_text(json.dumps(rates, indent=1, sort_keys=True))
        cells[name] = jobs_for(name, rates[name], seeds, all_n, steps, stages)
        if phase in ("runs", "all"):
            execute([j for js in cells[name].values() for j in js], out, workers, name)
    if phase == "runs":
        return {}
    if phase == "all":
        measure_times(out, names, all_n, stages=stages)
        measure_cost_per_row(out, names, stages=stages)
    times = json.loads((out / "step_times.json").read_text())
    costs_path = out / "cost_per_row.json"
    costs = json.loads(costs_path.read_text()) if costs_path.exists() else {}
    budget = {n: equal_time_jobs(n, rates[n], seeds, times, steps, stages) for n in names}
    if phase == "equal-time" or (phase == "all" and equal_time):
        for name in names:
            jobs = [j for js in budget[name].values() for j in js]
            execute(jobs, out, workers, f"{name}: at 1F1B's pipeline time")
        if phase == "equal-time":
            return {}
    results = {
        "tasks": {
            n: task_table(out, n, rates[n], cells[n], times, budget[n], costs.get(n), stages)
            for n in names
        },
        "held_out": HELD_OUT,
        "seeds": seeds,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    for name in names:
        plot_against_time(out, results, cells, name, budget[name])
    return results


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pipemare user-protocol", __doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/user-protocol"))
    add_tasks_argument(parser, sorted(TASKS), list(USER_TASKS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the task's)")
    parser.add_argument(
        "--all-n", action="store_true", help="N = 1 and N = P as well as the default N"
    )
    parser.add_argument(
        "--phase",
        choices=("all", "runs", "times", "equal-time", "table"),
        default="all",
        help="runs: train only; times: measure step times only (alone on the machine); "
        "equal-time: train pipemare given 1F1B's pipeline time (after times); "
        "table: tabulate what is stored",
    )
    parser.add_argument(
        "--equal-time",
        action="store_true",
        help="with --phase all: also train pipemare given 1F1B's pipeline time",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        type=int,
        default=list(STAGES),
        help=f"the P compared (default: {' '.join(map(str, STAGES))})",
    )
    args = parser.parse_args(argv)
    run_compare(
        args.out,
        args.tasks,
        args.seeds,
        args.workers,
        args.steps,
        args.all_n,
        args.phase,
        args.equal_time,
        tuple(args.stages),
    )
    if args.phase in ("all", "table"):
        print((args.out / "results.md").read_text())
