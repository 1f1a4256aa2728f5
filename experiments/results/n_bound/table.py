"""The tables of experiments/results/n_bound/README.md from what is stored: ``runs/*.json``
(the quality runs of run.py), ``cost_per_row-*.json`` (cost_per_row.py), ``wall_times.jsonl``
(run.py's log) and step times: ``step_times-*.json`` (times.py, measured alone; the median over
sittings) where present, else the user's protocol's stored step times
(experiments/results/user_protocol/step_times.json) for the configurations they cover.

    PYTHONPATH=. python experiments/results/n_bound/table.py --readme   # README.md, from a template

Quality: the final validation metric at equal steps (the run's last evaluation), per seed, the
mean and half the range over the seeds run so far, and the gap of the mean to one device's
(gpipe at P = 2, N = 1: what one device computes for the minibatch, and 1F1B's curve per step).
Reach: the first evaluated step at which a curve comes within 1% of one device's final loss
(0.5 point of its final accuracy, the project's REACH), per seed and on the seed-mean curve
(the mean over the seeds at each evaluated step); ``never``: not within the run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import SETUP, cells  # noqa: E402

from pipemare.experiments.studies.protocol import TASKS  # noqa: E402
from pipemare.experiments.studies.user_protocol import REACH, one_f_one_b_ns  # noqa: E402

STORED_TIMES = HERE.parent / "user_protocol" / "step_times.json"
STAGES = (2, 4, 8)


def _runs(out: Path, task: str, variant: str, p: int, n: int) -> list[dict[str, Any]]:
    lr, _ = SETUP[task]
    found = []
    for seed in range(10):
        path = out / "runs" / f"{task}-{variant}-P{p}-N{n}-lr{lr:g}-s{seed}.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


def _final(run: dict[str, Any]) -> float:
    m = run["metric"]
    return m[-1] if m and math.isfinite(m[-1]) else math.nan


def _reached(value: float, target: float, higher: bool) -> bool:
    return math.isfinite(value) and (value >= target if higher else value <= target)


def _reach(steps: list[int], metric: list[float], target: float, higher: bool) -> float:
    pairs = zip(steps, metric, strict=True)
    return next((s for s, m in pairs if _reached(m, target, higher)), math.inf)


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    length = min(len(r["steps"]) for r in runs)
    steps = runs[0]["steps"][:length]
    return steps, [statistics.fmean(r["metric"][i] for r in runs) for i in range(length)]


def _shown(step: float) -> str:
    return "never" if math.isinf(step) else f"{step:.0f}"


def _gap(value: float, ref: float, higher: bool) -> str:
    if not math.isfinite(value):
        return "—"
    if higher:
        return f"{100 * (value - ref):+.1f} pt"
    return f"{100 * (value / ref - 1):+.1f}%"


def _times(out: Path) -> tuple[dict[str, float], str]:
    sittings = [json.loads(p.read_text()) for p in sorted(out.glob("step_times-*.json"))]
    if sittings:
        keys = {k for s in sittings for k in s}
        times = {k: statistics.median(s[k] for s in sittings if k in s) for k in keys}
        return times, f"measured alone by times.py ({len(sittings)} sitting(s), the median)"
    stored = json.loads(STORED_TIMES.read_text())
    return stored, (
        "stored: experiments/results/user_protocol/step_times.json (`pipemare user-protocol "
        "--phase times`, per-action times measured alone and replayed, commit 1981ed1, "
        "2026-11-27); it covers 1F1B at every N and gpipe, async, pipemare at N = P only"
    )


def _quality(out: Path) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for task in SETUP:
        t = TASKS[task]
        higher = t.higher_is_better
        lr, steps = SETUP[task]
        gp = _runs(out, task, "gpipe", 2, 1)
        if not gp:
            lines += [f"### {task}", "", "(no one-device run stored yet)", ""]
            continue
        # the reference: one device over the seeds every cell run so far has (the same seeds
        # mean the same initial weights and data order); all of one device's seeds otherwise
        ran = [
            {r["seed"] for r in _runs(out, task, v, pp, n)}
            for p in STAGES
            for v, pp, n in cells(task, [p])
        ]
        common = set.intersection(*[s for s in ran if s]) if any(ran) else set()
        chosen = [r for r in gp if r["seed"] in common] or gp
        ref = statistics.fmean(_final(r) for r in chosen)
        target = ref - REACH["acc"] if higher else ref * (1 + REACH["loss"])
        metric = "validation accuracy" if higher else "validation loss"
        every = ", ".join(f"seed {r['seed']} {_final(r):.4f}" for r in gp)
        lines += [
            f"### {task} (dispatch-bound, small): {metric}, rate {lr:g}, "
            f"{steps or t.steps} steps, batch {t.batch}",
            "",
            f"One device (gpipe P = 2, N = 1): {every}. The reference, over the seeds every "
            f"cell run has ({', '.join(str(r['seed']) for r in chosen)}): final {ref:.4f}; "
            f"target {target:.4f} ({'0.5 point below' if higher else '1% above'}).",
            "",
            "| P | schedule | N | seeds | final per seed | mean ± half-range | gap vs one device "
            "| step within target, per seed | on the seed-mean curve |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rows = [(2, "gpipe (one device; 1F1B's curve)", 1, chosen)]
        for p in STAGES:
            for v, pp, n in cells(task, [p]):
                rows.append((pp, v, n, _runs(out, task, v, pp, n)))
        for p, v, n, runs in rows:
            p_text = "–" if v.startswith("gpipe") else str(p)
            if not runs:
                lines.append(f"| {p_text} | {v} | {n} | – | not run yet | | | | |")
                continue
            finals = [_final(r) for r in runs]
            mean = statistics.fmean(finals)
            half = (max(finals) - min(finals)) / 2
            per_seed = [_reach(r["steps"], r["metric"], target, higher) for r in runs]
            mean_reach = _reach(*_mean_curve(runs), target, higher)
            seeds = ", ".join(str(r["seed"]) for r in runs)
            lines.append(
                f"| {p_text} | {v} | {n} | {seeds} | {', '.join(f'{f:.4f}' for f in finals)} | "
                f"{mean:.4f} ± {half:.4f} | {_gap(mean, ref, higher)} | "
                f"{', '.join(_shown(s) for s in per_seed)} | {_shown(mean_reach)} |"
            )
            summary[f"{task}-{v.split()[0]}-P{p}-N{n}"] = {
                "seeds": [r["seed"] for r in runs],
                "finals": finals,
                "mean": mean,
                "half_range": half,
                "reach_per_seed": per_seed,
                "reach_mean_curve": mean_reach,
                "diverged": sum(bool(r.get("diverged")) for r in runs),
            }
        summary[f"{task}-ref"] = {"final": ref, "target": target, "higher": higher}
        lines.append("")
    return lines, summary


def _compact(summary: dict[str, Any]) -> list[str]:
    """Per task and P: the gap of the seed mean to one device at equal steps, and the step at
    which the seed-mean curve first comes within the target, per N."""
    lines = [
        "| task (regime) | P | async N = P | pipemare N = P | pipemare N = 2P | pipemare N = 4P |",
        "|---|---|---|---|---|---|",
    ]
    for task in SETUP:
        ref = summary.get(f"{task}-ref")
        if ref is None:
            continue
        higher = ref["higher"]
        for p in STAGES:
            shown = []
            for v, n in (("async", p), ("pipemare", p), ("pipemare", 2 * p), ("pipemare", 4 * p)):
                row = summary.get(f"{task}-{v}-P{p}-N{n}")
                if TASKS[task].batch % n:
                    shown.append("N > batch")
                elif row is None:
                    shown.append("not run")
                else:
                    seeds = len(row["seeds"])
                    shown.append(
                        f"{_gap(row['mean'], ref['final'], higher)} "
                        f"(±{_half(row['half_range'], ref['final'], higher)}, "
                        f"{seeds} seed{'s' * (seeds > 1)}), "
                        f"reach {_shown(row['reach_mean_curve'])}"
                    )
            lines.append(f"| {task} (dispatch-bound) | {p} | {' | '.join(shown)} |")
    return lines


def _half(value: float, ref: float, higher: bool) -> str:
    return f"{100 * value:.1f} pt" if higher else f"{100 * value / ref:.1f}%"


def _time_table(out: Path, summary: dict[str, Any]) -> list[str]:
    times, source = _times(out)
    lines = [
        f"Step times: {source}. 1F1B runs at its fastest N (N*) among the divisors of the "
        "batch; its curve per step is one device's, so it reaches the target at one device's "
        "seed-mean reach step. Time to target = reach step (seed-mean curve) × step time; "
        "ratio to 1F1B's.",
        "",
        "| task | P | schedule | N | step (ms) | × 1F1B's step | reach (seed-mean) "
        "| time to target × 1F1B's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task in SETUP:
        ref = summary.get(f"{task}-gpipe-P2-N1")
        if ref is None:
            continue
        t = TASKS[task]
        for p in STAGES:
            per = {n: times.get(f"{task}-1f1b-P{p}-N{n}", math.nan) for n in one_f_one_b_ns(t, p)}
            per = {n: s for n, s in per.items() if math.isfinite(s)}
            if not per:
                continue
            n_star = min(per, key=lambda n: (per[n], n))
            base = ref["reach_mean_curve"] * per[n_star]
            lines.append(
                f"| {task} | {p} | 1f1b (N*) | {n_star} | {1000 * per[n_star]:.2f} | 1.00 | "
                f"{_shown(ref['reach_mean_curve'])} | 1.00 |"
            )
            for v, pp, n in cells(task, [p]):
                row = summary.get(f"{task}-{v}-P{pp}-N{n}")
                step = times.get(f"{task}-{v}-P{pp}-N{n}", math.nan)
                if row is None:
                    continue
                if not math.isfinite(step) and not math.isinf(row["reach_mean_curve"]):
                    lines.append(
                        f"| {task} | {p} | {v} | {n} | pending | | "
                        f"{_shown(row['reach_mean_curve'])} | pending |"
                    )
                    continue
                reach = row["reach_mean_curve"]
                ratio = "never" if math.isinf(reach) else f"{reach * step / base:.2f}"
                shown = (
                    f"{1000 * step:.2f} | {step / per[n_star]:.2f}"
                    if math.isfinite(step)
                    else "pending |"
                )
                lines.append(f"| {task} | {p} | {v} | {n} | {shown} | {_shown(reach)} | {ratio} |")
    return lines


def _cost_table(out: Path) -> list[str]:
    sittings = [json.loads(p.read_text()) for p in sorted(out.glob("cost_per_row-*.json"))]
    if not sittings:
        return ["(no cost per row stored)"]
    lines = [
        "| task | rows (N) | wall ms/row, per sitting | CPU ms/row, per sitting "
        "| CPU × the whole batch's row, per sitting | within 1.25× |",
        "|---|---|---|---|---|---|",
    ]
    for task in SETUP:
        batch = TASKS[task].batch
        for rows in sorted((int(r) for r in sittings[0][task]), reverse=True):
            wall = [s[task][str(rows)]["median"] for s in sittings]
            cpu = [s[task][str(rows)]["cpu"] for s in sittings]
            ratio = [s[task][str(rows)]["cpu"] / s[task][str(batch)]["cpu"] for s in sittings]
            ok = "yes" if max(ratio) <= 1.25 else ("no" if min(ratio) > 1.25 else "mixed")
            lines.append(
                f"| {task} | {rows} ({batch // rows}) | "
                f"{', '.join(f'{1000 * w:.2f}' for w in wall)} | "
                f"{', '.join(f'{1000 * c:.2f}' for c in cpu)} | "
                f"{', '.join(f'{r:.2f}' for r in ratio)} | {ok} |"
            )
    return lines


def _wall_table(out: Path) -> list[str]:
    path = out / "wall_times.jsonl"
    lines = [
        "| run | training seconds (run_task) | wall seconds incl. setup (shared machine) |",
        "|---|---|---|",
    ]
    if not path.exists():
        return lines
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        stored = out / "runs" / f"{entry['key']}.json"
        seconds = json.loads(stored.read_text())["seconds"] if stored.exists() else math.nan
        lines.append(f"| {entry['key']} | {seconds:.0f} | {entry['wall_s']:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument(
        "--readme", action="store_true", help="write OUT/README.md from README.template.md"
    )
    args = parser.parse_args()
    q, summary = _quality(args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    parts = [
        "## Summary: gap to one device at equal steps, and reach",
        "",
        *_compact(summary),
        "",
        "## Quality at equal steps",
        "",
        *q,
        "## Time to target (replayed step times)",
        "",
        *_time_table(args.out, summary),
        "",
        "## Cost per row (the cap)",
        "",
        *_cost_table(args.out),
        "",
        "## Time per run (shared machine, not step times)",
        "",
        *_wall_table(args.out),
        "",
    ]
    text = "\n".join(parts)
    if args.readme:
        template = (args.out / "README.template.md").read_text()
        (args.out / "README.md").write_text(template.replace("{{TABLES}}", text.rstrip() + "\n"))
    else:
        print(text)


if __name__ == "__main__":
    main()
