"""Issue 61's horizon runs: ``gpt_c64s`` at ten times the main job's length, quality only.

One run per call, through the protocol's own engine
(:func:`~pipemare.experiments.studies.fair.execute` with one worker): every stage simulated in
this process with the staleness of one process per stage, the task's nanoGPT recipe with
warm-up and cosine over the whole run, the validation loss every ``eval_every`` steps on the
live weights. Step times are not measured here.

- ``python experiments/studies/horizon.py run --variant pipemare --stages 4 --seed 0``: trains
  one run into ``OUT/runs/KEY.json`` (the protocol's format) and writes its curve to
  ``OUT/gpt_c64s-VARIANT-P{P}-N{N}-s{SEED}-{STEPS}steps.json`` with the command that made it.
- ``python experiments/studies/horizon.py times``: each schedule's pipeline seconds per step
  at P = 2, 4, 8 (1F1B at every N it could run, gpipe, ``async`` and ``pipemare`` at N = P and
  2P, and on ``gpt_c64s`` ``pipemare-noWP`` at N = P), from per-action times measured once and
  replayed with each stage on a device of its own
  (:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`: the windows of every
  configuration at one P taken in turn), into ``OUT/step_times-{SITTING}.json`` with when each
  P was taken and the load average before it; the table reads each configuration within each
  sitting, against that sitting's fastest 1F1B (:func:`_median_times`), those measured in
  turn only where any is (a
  sitting before 2026-12-01's took one configuration after another). Run it alone on the
  machine: stop any queue (``kill -STOP``) for the sitting's length.
- ``python experiments/studies/horizon.py table``: ``OUT/README.md`` from the curves written
  so far (final validation loss per (schedule, P, N, seed), mean, spread, gap to one device)
  and, with the step times, each cell's pipeline time to 1F1B's final quality against 1F1B's
  own at its fastest N.

"One device" is gpipe (P = 2, N = 1, as the user protocol runs it): it computes what one device
computes for the minibatch, and so does 1F1B.

``--variant pipemare+T3w240`` (and T3w120, T3w480, T3w800: 5% to a third of the run) trains
the default with T3, its first K steps synchronous (1F1B at the same P and N) and asynchronous
after; ``table`` charges those K steps at 1F1B's step at that P and N, and the rest at
pipemare's.

``--variant pipemare-noWP`` trains the default without weight prediction, at P = 4 the
correction that costs the step most (``experiments/results/horizon/corrections_cost.py
--ablate``); its queue
(``queue_nowp.sh``) trains into ``experiments/results/horizon_nowp`` (``--out``: the protocol's
run files and the logs), and its curves were moved here, beside the default's, for the tables.

``--task gpt_c64s_halves`` (each command) runs the same GPT cut between each block's attention
and its MLP as well (``experiments/results/horizon_halves``): a cut does not change what one
device computes, so ``table`` there reads gpt_c64s's one-device runs beside the runs of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_OUT = _ROOT / "experiments" / "results" / "horizon"
_TASK = "gpt_c64s"  # or TASKS_HERE's other, set by --task before any command runs
#: the tasks this study runs, each with its results folder
TASKS_HERE = {"gpt_c64s": _OUT, "gpt_c64s_halves": _OUT.with_name("horizon_halves")}
_RATE = 1e-3
_STEPS = 2400


def _commit() -> str:
    """The commit the imported code was archived from (the queue sets it), and where it is."""
    code = Path(sys.modules["pipemare"].__file__ or "").resolve().parents[1]
    return f"{os.environ.get('HORIZON_CODE_COMMIT', 'unknown')} (imported from {code})"


#: T3's variants (experiments/studies/grid.py's T3_HORIZON): the first K steps synchronous
#: (1F1B), the default pipemare after
T3_VARIANTS = tuple(f"pipemare+T3w{k}" for k in (120, 240, 480, 800))


def _synchronous_steps(variant: str) -> int:
    """The steps a T3 variant runs synchronously (0 for any other)."""
    return int(variant.rsplit("+T3w", 1)[1]) if "+T3w" in variant else 0


def _name(variant: str, stages: int, n: int, seed: int, steps: int, lr: float = _RATE) -> str:
    rate = "" if lr == _RATE else f"-lr{lr:g}"  # the re-tune's other rates
    return f"{_TASK}-{variant}-P{stages}-N{n}-s{seed}-{steps}steps{rate}"


def _run(args: argparse.Namespace) -> None:
    import torch

    import pipemare
    from pipemare.experiments.studies.fair import execute
    from pipemare.experiments.studies.grid import Job, load_result
    from pipemare.experiments.studies.protocol import TASKS
    from pipemare.experiments.studies.user_protocol import auto_n

    torch.set_num_threads(1)
    task = TASKS[_TASK]
    stages, n = args.stages, args.microbatches
    if args.variant == "gpipe":
        stages, n = 2, 1  # one device's computation, as the user protocol runs it
    elif n is None:
        n = auto_n(task, stages)
    # the protocol's run key has no length: another horizon is told apart by a suffix, so that
    # it neither reuses nor overwrites the 2,400-step run of the same configuration
    suffix = "" if args.steps == _STEPS else f"-{args.steps}steps"
    job = Job(_TASK, args.variant, stages, n, args.lr, args.seed, args.steps, suffix)
    out = Path(args.out)
    execute([job], out, 1, job.key)
    result = load_result(out, job)
    final = result.metric[-1] if result.metric else math.nan
    record: dict[str, Any] = {
        "task": _TASK,
        "schedule": args.variant,
        "label": "one device (gpipe; 1F1B computes the same)"
        if args.variant == "gpipe"
        else (f"{args.variant} at P = {stages}, N = {n}")
        + (
            f" (T3: the first {_synchronous_steps(args.variant)} steps synchronous, 1F1B)"
            if _synchronous_steps(args.variant)
            else ""
        ),
        "synchronous_steps": _synchronous_steps(args.variant),
        "stages": stages,
        "microbatches": n,
        "default_n": auto_n(task, stages),
        "seed": args.seed,
        "steps": args.steps,
        "lr": args.lr,
        "recipe": "nanoGPT: AdamW 0.9/0.95, weight decay 0.1, warm-up over the first tenth, "
        "cosine to 0 over the whole run",
        "batch": task.batch,
        "eval_every": task.eval_every,
        "curve": [[s, m] for s, m in zip(result.steps, result.metric, strict=True)],
        "final_val_loss": final,
        "best_val_loss": result.best(False),
        "train_loss": result.train_loss,
        "diverged": result.diverged,
        "refused": result.refused,
        "setup": result.setup,
        "wall_seconds_shared_machine": result.seconds,
        "command": os.environ.get("HORIZON_COMMAND")
        or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "code": _commit(),
        "pipemare_file": pipemare.__file__,
        "protocol_run": str(out / "runs" / f"{job.key}.json"),
    }
    path = out / f"{_name(args.variant, stages, n, args.seed, args.steps, args.lr)}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"{path.name}: final validation loss {final:.4f} ({result.seconds:.0f} s)", flush=True)


def _fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def _first_within(curve: list[list[float]], target: float) -> int | None:
    """The first evaluated step whose loss is within 1% of ``target`` (None: never)."""
    return next((int(s) for s, m in curve if m <= 1.01 * target), None)


#: the key under which a sitting says how its windows were taken
_METHOD = "_method"

#: the key under which a sitting names the engine it timed, and the engine timed now: the
#: tables read the sittings of the newest engine where any timed it (until 630b890 every
#: asynchronous stage ran Python saved-tensor hooks, 8-10% of its forwards and backwards)
_ENGINE, ENGINE = "_engine", "no saved-tensor hooks on live-weight stages (630b890)"

#: the links the pipeline-time table replays beside the free one (issue 62): Ethernet between
#: nodes, and a slow link between sites; the measured gloo link is added per sitting
LINKS = {"10Gb/s@20us": "10Gb/s@20us", "1Gb/s@1ms": "1Gb/s@1ms"}


def _times(args: argparse.Namespace) -> None:
    import torch

    from pipemare.engine.link import Link
    from pipemare.experiments.studies.grid import VARIANTS
    from pipemare.experiments.studies.protocol import TASKS, interleaved_step_times
    from pipemare.experiments.studies.user_protocol import auto_n, one_f_one_b_ns

    torch.set_num_threads(1)  # one core per stage's work, as the runs train
    path = Path(args.out) / f"step_times-{args.sitting}.json"
    times: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if times and times.get(_METHOD) != "interleaved":
        raise SystemExit(
            f"sitting {args.sitting} took its configurations one after another; a sitting's "
            "windows are taken in turn now: give a new --sitting"
        )
    if times and times.get(_ENGINE) != ENGINE:
        raise SystemExit(f"sitting {args.sitting} timed another engine: give a new --sitting")
    task = TASKS[_TASK]
    links = {name: Link.parse(spec) for name, spec in LINKS.items()}
    if args.gloo_link:  # its figures in the sitting's file, under a key no median reads
        links["gloo (measured)"] = Link.parse(args.gloo_link)
        times[f"_gloo_link_sitting_{args.sitting}"] = args.gloo_link
    times[_METHOD], times[_ENGINE] = "interleaved", ENGINE
    for p in args.stages:
        n = auto_n(task, p)
        keys = [("1f1b", p, m) for m in one_f_one_b_ns(task, p)]
        keys += [("gpipe", p, n), ("async", p, n), ("pipemare", p, n), ("pipemare", p, 2 * n)]
        if _TASK == "gpt_c64s":  # the default without weight prediction ran on this cut only
            keys += [("pipemare-noWP", p, n)]
        names = [""] + [f"@{name}" for name in links] if args.links else [""]
        todo = [
            k for k in keys if not all(f"{_TASK}-{k[0]}-P{p}-N{k[2]}{at}" in times for at in names)
        ]
        if not todo:
            continue
        if len(todo) < len(keys):
            raise SystemExit(
                f"sitting {args.sitting} timed P = {p} without {', '.join(map(str, todo))}; "
                "timed now they would not take their windows in turn with the others: give a "
                "new --sitting"
            )
        start, load = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]
        found = interleaved_step_times(
            task,
            todo,
            None,
            12,
            warm=8,
            repeats=3,
            links=links if args.links else None,
            variants=VARIANTS,
        )
        end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # when, and on how busy a machine (the 1-minute load average before it)
        times[f"_P{p}_taken"] = {"start": start, "end": end, "load_before": load}
        for (v, stages, m), by_link in found.items():
            key = f"{_TASK}-{v}-P{stages}-N{m}"
            for name, seconds in by_link.items():
                times[key if name == "free" else f"{key}@{name}"] = seconds
            print(f"{key}: {1000 * times[key]:.1f} ms", flush=True)
        path.write_text(json.dumps(times, indent=1, sort_keys=True))


def _sittings(out: Path) -> list[dict[str, Any]]:
    """The step-time sittings the tables read: those of the engine timed now (``ENGINE``)
    where any timed it, else those whose windows were taken in turn where any were
    (:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`), else all."""
    every = [json.loads(p.read_text()) for p in sorted(out.glob("step_times-*.json"))]
    interleaved = [s for s in every if s.get(_METHOD) == "interleaved"]
    current = [s for s in interleaved if s.get(_ENGINE) == ENGINE]
    return current or interleaved or every


def _time_cells(
    times: dict[str, float],
    cells: dict[tuple[str, int, int, int], dict[int, dict[str, Any]]],
    link: str = "",
) -> list[dict[str, Any]]:
    """Per horizon and P: 1F1B at its fastest N (over ``link``; "": communication free)
    reaches its own final quality (one device's: it computes what one device computes) at one
    device's reach step; every other cell at its own. One dict per row: steps, P, schedule, N,
    step_s, step_vs_1f1b, reach (None: never), time_s, time_vs_1f1b (None: never)."""
    at = f"@{link}" if link else ""
    out: list[dict[str, Any]] = []
    for (v, _, _, steps), seeds in sorted(cells.items(), key=lambda c: c[0][3]):
        if v != "gpipe":
            continue
        target = statistics.fmean(r["final_val_loss"] for r in seeds.values())
        for p in sorted({k[1] for k in cells if k[0] != "gpipe" and k[3] == steps}):
            prefix = f"{_TASK}-1f1b-P{p}-N"
            ns = _one_f_one_b(times, p, link)
            if not ns:
                continue
            n_star = min(ns, key=lambda m: (ns[m], m))
            base_step = ns[n_star]
            reach = _mean_reach(list(seeds.values()), target)
            base = reach * base_step if reach is not None else math.nan
            out.append(
                {
                    "steps": steps,
                    "P": p,
                    "schedule": "1f1b",
                    "N": n_star,
                    "step_s": base_step,
                    "step_vs_1f1b": 1.0,
                    "reach": reach,
                    "time_s": base,
                    "time_vs_1f1b": 1.0,
                }
            )
            for (cv, cp, n, st), runs in sorted(cells.items()):
                if cp != p or cv == "gpipe" or st != steps:
                    continue
                schedule, sync = cv.split("+", 1)[0], _synchronous_steps(cv)
                step = times.get(f"{_TASK}-{schedule}-P{p}-N{n}{at}", math.nan)
                reach = _mean_reach(list(runs.values()), target)
                time = _pipeline_time(reach, step, sync, times.get(f"{prefix}{n}{at}", math.nan))
                out.append(
                    {
                        "steps": steps,
                        "P": p,
                        "schedule": cv,
                        "N": n,
                        "step_s": step,
                        "step_vs_1f1b": step / base_step,
                        "reach": reach,
                        "time_s": time,
                        "time_vs_1f1b": time / base if reach is not None else None,
                    }
                )
    return out


def _one_f_one_b(times: Mapping[str, float], p: int, link: str = "") -> dict[int, float]:
    """1F1B's step at each N it was timed at, at ``p`` stages over ``link`` ("": free).

    Example:
        >>> t = {"gpt_c64s-1f1b-P2-N2": 2.0, "gpt_c64s-1f1b-P2-N4@1Gb/s@1ms": 3.0}
        >>> _one_f_one_b(t, 2), _one_f_one_b(t, 2, "1Gb/s@1ms")
        ({2: 2.0}, {4: 3.0})
    """
    prefix, at = f"{_TASK}-1f1b-P{p}-N", f"@{link}" if link else ""
    return {
        int(k[len(prefix) :].split("@")[0]): t
        for k, t in times.items()
        if k.startswith(prefix) and k.endswith(at) and ("@" in k) == bool(at) and math.isfinite(t)
    }


def _fastest_1f1b(times: Mapping[str, float], p: int, link: str = "") -> float | None:
    """1F1B's fastest step at ``p`` stages over ``link`` in ``times`` (one sitting's), or None.

    Example:
        >>> _fastest_1f1b({"gpt_c64s-1f1b-P2-N2": 2.0, "gpt_c64s-1f1b-P2-N4": 1.6}, 2)
        1.6
    """
    ns = _one_f_one_b(times, p, link)
    return min(ns.values()) if ns else None


def _pipeline_time(reach: float | None, step: float, sync: int, sync_step: float) -> float:
    """Seconds to ``reach`` steps at ``step`` seconds each, the first ``sync`` of them (T3's)
    charged at ``sync_step``, 1F1B's at the same P and N (NaN: never reached).

    Example:
        >>> _pipeline_time(100, 1.0, 0, 9.0), _pipeline_time(100, 1.0, 20, 3.0)
        (100.0, 140.0)
        >>> _pipeline_time(10, 1.0, 20, 3.0), _pipeline_time(None, 1.0, 0, 3.0)
        (30.0, nan)
    """
    if reach is None:
        return math.nan
    early = min(reach, sync)
    return early * sync_step + (reach - early) * step


def _time_rows(
    times: dict[str, float],
    cells: dict[tuple[str, int, int, int], dict[int, dict[str, Any]]],
    link: str = "",
) -> list[str]:
    """:func:`_time_cells` as a Markdown table."""
    rows = [
        "| steps | P | schedule | N | step (ms) | step × 1F1B's | step within 1% of 1F1B's final "
        "(seed-mean curve) | pipeline time to it (s) | × 1F1B's time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in _time_cells(times, cells, link):
        name = c["schedule"]
        if name == "1f1b":
            name = "1f1b (its fastest N; one device's curve)"
        ratio = "never" if c["time_vs_1f1b"] is None else f"{c['time_vs_1f1b']:.2f}"
        rows.append(
            f"| {c['steps']} | {c['P']} | {name} | {c['N']} | {1000 * c['step_s']:.1f} | "
            f"{c['step_vs_1f1b']:.2f} | {_shown(c['reach'])} | {c['time_s']:.1f} | {ratio} |"
        )
    return rows


def _link_tables(
    times: dict[str, float], cells: dict[tuple[str, int, int, int], dict[int, dict[str, Any]]]
) -> list[str]:
    """One pipeline-time table per link replayed (those of the latest sitting that has any)."""
    names = sorted({k.split("@", 1)[1] for k in times if "@" in k})
    out: list[str] = []
    for name in names:
        rows = _time_rows(times, cells, name)
        if len(rows) > 2:
            out += ["", f"**Over {name}** (every link of the pipeline):", "", *rows]
    return out


def _mean_reach(runs: list[dict[str, Any]], target: float) -> float | None:
    """The seed-mean curve's first evaluated step within 1% of ``target`` (None: never)."""
    if not all(len(r["curve"]) == len(runs[0]["curve"]) for r in runs):
        return None
    return next((s for s, m in _mean_curve(runs) if m <= 1.01 * target), None)


def _along_rows(cells: dict[tuple[str, int, int, int], dict[int, dict[str, Any]]]) -> list[str]:
    """Each cell's seed-mean gap to one device's seed-mean curve at equal steps along the run
    (at the same fractions of each horizon): whether a penalty is an offset that closes or one
    that lasts."""
    fractions = [(1, 24), (1, 12), (1, 6), (1, 4), (1, 2), (3, 4), (1, 1)]
    rows = [
        "| steps | schedule | P | N | seeds | "
        + " | ".join(f"{a}/{b} of the run" if b > 1 else "end" for a, b in fractions)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(fractions),
    ]
    for (v, _, _, steps), one in sorted(cells.items(), key=lambda c: c[0][3]):
        if v != "gpipe":
            continue
        base = dict(_mean_curve(list(one.values())))
        points = [steps * a // b for a, b in fractions]
        for (cv, p, n, st), runs in sorted(cells.items()):
            if cv == "gpipe" or st != steps:
                continue
            curve = dict(_mean_curve(list(runs.values())))
            gaps = [
                f"{100 * (curve[s] / base[s] - 1):+.1f}% (step {s})"
                if s in curve and s in base
                else ""
                for s in points
            ]
            rows.append(f"| {steps} | {cv} | {p} | {n} | {len(runs)} | " + " | ".join(gaps) + " |")
    return rows


def _rate_rows(records: list[dict[str, Any]]) -> list[str]:
    """The one-device rate re-tuned at each horizon: final validation loss per rate and seed."""
    rows = [
        "| steps | lr | seeds | final validation loss per seed | mean |",
        "|---|---|---|---|---|",
    ]
    cells: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in records:
        if r["schedule"] == "gpipe":
            cells.setdefault((r["steps"], r["lr"]), []).append(r)
    for (steps, lr), runs in sorted(cells.items()):
        runs.sort(key=lambda r: r["seed"])
        values = [r["final_val_loss"] for r in runs]
        tag = " (the task's rate)" if lr == _RATE else ""
        rows.append(
            f"| {steps} | {lr:g}{tag} | "
            f"{', '.join(str(r['seed']) for r in runs)} | {_fmt(values)} | "
            f"{statistics.fmean(values):.3f} |"
        )
    return rows


def _mean_curve(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The seeds' mean validation loss at each step all of them evaluated."""
    length = min(len(r["curve"]) for r in runs)
    return [
        (runs[0]["curve"][i][0], statistics.fmean(r["curve"][i][1] for r in runs))
        for i in range(length)
    ]


def _shown(reach: float | None) -> str:
    return "never" if reach is None else f"{reach:.0f}"


Cells = dict[tuple[str, int, int, int], dict[int, dict[str, Any]]]


def _cells(records: list[dict[str, Any]]) -> Cells:
    """(schedule, P, N, steps) -> seed -> its run."""
    cells: Cells = {}
    for r in records:
        key = (r["schedule"], r["stages"], r["microbatches"], r["steps"])
        cells.setdefault(key, {})[r["seed"]] = r
    return cells


def _quality(cells: Cells) -> list[dict[str, Any]]:
    """One dict per cell: its seeds' finals, mean, spread (half the range), gap to one
    device's mean at the same horizon (None for one device), and its reach (the seed-mean
    curve's first step within 1% of one device's final mean; None: never) with each seed's."""
    order = {"gpipe": 0, "pipemare": 1, "async": 2}
    base: dict[int, float] = {}
    for (v, _, _, steps), seeds in cells.items():
        if v == "gpipe":
            base[steps] = statistics.fmean(r["final_val_loss"] for r in seeds.values())
    out = []
    for (v, p, n, steps), seeds in sorted(
        cells.items(), key=lambda c: (order.get(c[0][0], 9), *c[0][1:])
    ):
        runs = [seeds[s] for s in sorted(seeds)]
        values = [r["final_val_loss"] for r in runs]
        mean = statistics.fmean(values)
        cell: dict[str, Any] = {
            "schedule": v,
            "P": None if v == "gpipe" else p,
            "N": None if v == "gpipe" else n,
            "steps": steps,
            "seeds": sorted(seeds),
            "finals": values,
            "mean": mean,
            "spread": (max(values) - min(values)) / 2,
            "gap": None if v == "gpipe" or steps not in base else mean / base[steps] - 1,
            "reach": None,
            "reach_per_seed": None,
        }
        if steps in base and all(len(r["curve"]) == len(runs[0]["curve"]) for r in runs):
            curve = [list(point) for point in _mean_curve(runs)]
            cell["reach"] = _first_within(curve, base[steps])
            cell["reach_per_seed"] = [_first_within(r["curve"], base[steps]) for r in runs]
        out.append(cell)
    return out


def _quality_rows(cells: Cells) -> list[str]:
    rows = [
        "| schedule | P | N | steps | seeds | final validation loss per seed | mean | spread "
        "(half-range) | gap to one device (mean) | step within 1% of one device's final: "
        "seed-mean curve (per seed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in _quality(cells):
        gap = "" if c["gap"] is None else f"{100 * c['gap']:+.1f}%"
        reach = ""
        if c["reach_per_seed"] is not None:
            each = ", ".join(_shown(r) for r in c["reach_per_seed"])
            reach = f"{_shown(c['reach'])} ({each})"
        where = "one device" if c["schedule"] == "gpipe" else f"{c['P']}"
        rows.append(
            f"| {c['schedule']} | {where} | {'' if c['N'] is None else c['N']} | {c['steps']} | "
            f"{', '.join(map(str, c['seeds']))} | {_fmt(c['finals'])} | {c['mean']:.3f} | "
            f"±{c['spread']:.3f} | {gap} | {reach} |"
        )
    return rows


def _retuned(every: list[dict[str, Any]], times: dict[str, float]) -> list[str]:
    """The same tables at each other rate where a schedule besides one device ran."""
    out: list[str] = []
    for lr in sorted({r["lr"] for r in every} - {_RATE}):
        at = [r for r in every if r["lr"] == lr]
        if not any(r["schedule"] != "gpipe" for r in at):
            continue
        cells = _cells(at)
        timed = _time_rows(times, cells) if times else []
        out += [
            "",
            f"### At {lr:g}, every schedule (one device included) at this rate",
            "",
            *_quality_rows(cells),
            "",
            "Pipeline time to 1F1B's final quality at this rate (step times as below):",
            "",
            *(timed or ["(no step times measured yet)"]),
            "",
            "The gap along the run at this rate (against one device's seed-mean curve here):",
            "",
            *_along_rows(cells),
        ]
    return out or ["(no schedule besides one device has finished at another rate yet)"]


def _verdict(
    every: list[dict[str, Any]], times: dict[str, float], sittings: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """What the product's verdicts read (the main job's stored study, the README): per rate,
    each cell's quality and, where the step times are measured, its pipeline time to 1F1B's
    final quality, communication free; and each sitting's own step ratio of the default
    (:func:`_sitting_ratios`)."""
    cells = []
    for lr in sorted({r["lr"] for r in every}):
        at = _cells([r for r in every if r["lr"] == lr])
        timed = {(c["steps"], c["P"], c["schedule"], c["N"]): c for c in _time_cells(times, at)}
        for c in _quality(at):
            t = timed.get((c["steps"], c["P"], c["schedule"], c["N"]), {})
            ones = [v for k, v in timed.items() if k[:3] == (c["steps"], c["P"], "1f1b")]
            cells.append(
                {
                    "lr": lr,
                    **c,
                    "step_vs_1f1b": _finite(t.get("step_vs_1f1b")),
                    "time_vs_1f1b": _finite(t.get("time_vs_1f1b")),
                    "one_f_one_b_n": ones[0]["N"] if ones else None,
                }
            )
    links = {  # the same cells' pipeline time replayed over each link (the task's rate)
        name: [
            {k: _finite(c[k]) if k.endswith("_1f1b") else c[k] for k in _LINK_KEYS}
            for c in _time_cells(times, _cells([r for r in every if r["lr"] == _RATE]), name)
        ]
        for name in sorted({k.split("@", 1)[1] for k in times if "@" in k})
    }
    return {
        "about": (
            f"{_TASK} (a GPT whose stages cost about their rows) trained for the steps named, "
            "every stage simulated in one process with one process per stage's staleness; "
            "gap: the seed-mean final validation loss against one device's at the same rate "
            "and steps; time_vs_1f1b: pipeline time to 1F1B's final quality (one device's) "
            "against 1F1B's at its fastest N, from per-action times measured alone and "
            "replayed, communication free (null: never within the run); sitting_step_ratios: "
            "per P, each step-time sitting's own ratio of the default's step to 1F1B's at that "
            "sitting's fastest N, and their median. Written by "
            "`python experiments/studies/horizon.py table` from the curves in this folder."
        ),
        "task": _TASK,
        "task_rate": _RATE,
        "main_job_steps": 240,
        "cells": cells,
        "over_links": links,
        "sitting_step_ratios": _sitting_ratios(sittings),
    }


_LINK_KEYS = ("steps", "P", "schedule", "N", "step_vs_1f1b", "time_vs_1f1b")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _sitting_ratios(sittings: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per P, each sitting's own step ratio: the default (pipemare at N = P) over 1F1B at that
    sitting's fastest N, communication free, and their median. The tables read each sitting
    the same way (:func:`_median_times`) but set one 1F1B N for all sittings, the one fastest
    in their reading, so where the fastest N changes between sittings the two differ a little.

    Example:
        >>> one = {"gpt_c64s-1f1b-P2-N2": 2.0, "gpt_c64s-1f1b-P2-N4": 1.6}
        >>> one["gpt_c64s-pipemare-P2-N2"] = 1.2  # over that sitting's fastest 1F1B, N = 4
        >>> two = {"gpt_c64s-1f1b-P2-N2": 4.0, "gpt_c64s-pipemare-P2-N2": 3.0}
        >>> _sitting_ratios([one, two])["P2"]
        {'each': [0.75, 0.75], 'median': 0.75}
    """
    out: dict[str, dict[str, Any]] = {}
    for p in sorted({_shape(k)[0] for s in sittings for k in s if not k.startswith("_")}):
        each = []
        for s in sittings:
            ref, default = _fastest_1f1b(s, p), s.get(f"{_TASK}-pipemare-P{p}-N{p}")
            if ref and default is not None and math.isfinite(default):
                each.append(round(default / ref, 4))
        if each:
            out[f"P{p}"] = {"each": each, "median": round(statistics.median(each), 4)}
    return out


def _shape(key: str) -> tuple[int, str]:
    """A step-time key's P and link ("": communication free).

    Example:
        >>> _shape("gpt_c64s-pipemare-noWP-P4-N8@1Gb/s@1ms"), _shape("gpt_c64s-1f1b-P2-N1")
        ((4, '1Gb/s@1ms'), (2, ''))
    """
    shape, _, link = key.partition("-P")[2].partition("@")  # "4-N8", "" or a link
    return int(shape.split("-N")[0]), link


def _median_times(sittings: list[dict[str, Any]]) -> dict[str, float]:
    """Each configuration's step, read within each sitting: its ratio to that sitting's fastest
    1F1B at the same P and link, the median of that ratio over the sittings that timed it, times
    the median of the fastest 1F1B over every sitting. A ratio between two configurations is
    then one measured within sittings, whatever the machine's speed did between them (on this
    two-core machine it moved 20% within an hour, and a median of each configuration's own
    steps then compared one sitting's pipemare with another's 1F1B: 0.88x against 0.80x the
    sittings' own ratios at P = 2). A configuration that fewer sittings timed (one added later)
    is read within those sittings.

    Example:
        >>> one = {"gpt_c64s-1f1b-P2-N2": 2.0, "gpt_c64s-pipemare-P2-N2": 1.0}
        >>> two = {"gpt_c64s-1f1b-P2-N2": 4.0, "gpt_c64s-pipemare-P2-N2": 3.0}
        >>> late = {**two, "gpt_c64s-pipemare-noWP-P2-N2": 2.0}
        >>> t = _median_times([one, late])
        >>> t["gpt_c64s-1f1b-P2-N2"], t["gpt_c64s-pipemare-P2-N2"]  # 3.0 x (0.5 + 0.75)/2
        (3.0, 1.875)
        >>> t["gpt_c64s-pipemare-noWP-P2-N2"]  # 2/4 of 1F1B's 3.0
        1.5
    """
    keys = {k for s in sittings for k in s if not k.startswith("_")}
    shapes = {_shape(k) for k in keys}
    # per sitting, 1F1B's fastest step at each P and link it timed, and its median over them
    fastest = {shape: [_fastest_1f1b(s, *shape) for s in sittings] for shape in shapes}
    scale = {
        shape: statistics.median(known) if (known := [r for r in refs if r]) else None
        for shape, refs in fastest.items()
    }
    out: dict[str, float] = {}
    for k in keys:
        shape = _shape(k)
        ratios = [
            s[k] / ref
            for s, ref in zip(sittings, fastest[shape], strict=True)
            if k in s and ref and math.isfinite(s[k])
        ]
        if ratios and scale[shape] is not None:
            out[k] = statistics.median(ratios) * scale[shape]
        else:  # no 1F1B beside it, or never finite (a configuration the pipeline refuses)
            out[k] = statistics.median(s[k] for s in sittings if k in s)
    return out


def _table(args: argparse.Namespace) -> None:
    out = Path(args.out)
    every = [json.loads(p.read_text()) for p in sorted(out.glob(f"{_TASK}-*steps*.json"))]
    if _TASK != "gpt_c64s":  # a cut changes nothing one device computes: gpt_c64s's own runs
        ones = sorted(TASKS_HERE["gpt_c64s"].glob("gpt_c64s-gpipe-*steps*.json"))
        every += [json.loads(p.read_text()) for p in ones]
    records = [r for r in every if r["lr"] == _RATE]
    cells = _cells(records)
    sittings = _sittings(out)
    times = _median_times(sittings)
    timed = _time_rows(times, cells) if times else []
    template = (out / "README.template.md").read_text()
    (out / "README.md").write_text(
        template.replace("{{TABLE}}", "\n".join(_quality_rows(cells)))
        .replace("{{COUNT}}", str(len(records)))
        .replace("{{TIMES}}", "\n".join(timed) or "(no step times measured yet)")
        .replace("{{LINKS}}", "\n".join(_link_tables(times, cells)) or "(no link replayed yet)")
        .replace("{{ALONG}}", "\n".join(_along_rows(cells)))
        .replace("{{RATES}}", "\n".join(_rate_rows(every)))
        .replace("{{RETUNED}}", "\n".join(_retuned(every, times)))
    )
    verdict = json.dumps(_verdict(every, times, sittings), indent=1, allow_nan=False)
    (out / "verdict.json").write_text(verdict + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="train one run and write its curve")
    run.add_argument(
        "--variant",
        required=True,
        choices=("gpipe", "pipemare", "async", "pipemare-noWP", *T3_VARIANTS),
    )
    run.add_argument("--stages", type=int, default=2)
    run.add_argument("--microbatches", type=int, help="N (default: the strategy's default N)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int, default=_STEPS)
    run.add_argument("--lr", type=float, default=_RATE)
    run.add_argument("--out", default=str(_OUT))
    table = sub.add_parser("table", help="write OUT/README.md from the curves so far")
    table.add_argument("--out", default=str(_OUT))
    times = sub.add_parser("times", help="replayed step times at P = 2, 4, 8 (run it alone)")
    times.add_argument("--out", default=str(_OUT))
    times.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    times.add_argument("--sitting", type=int, default=1, help="a sitting's number (its file)")
    times.add_argument(
        "--links", action="store_true", help="replay the same windows over LINKS too"
    )
    times.add_argument("--gloo-link", help="the gloo link measured between two processes")
    for command in (run, table, times):
        command.add_argument(
            "--task", choices=tuple(TASKS_HERE), default="gpt_c64s", help="the GPT's cut"
        )
    args = parser.parse_args(argv)
    global _TASK
    _TASK = args.task
    if args.out == str(_OUT):  # the task's own folder unless one is named
        args.out = str(TASKS_HERE[args.task])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"run": _run, "table": _table, "times": _times}[args.what](args)


if __name__ == "__main__":
    main()
