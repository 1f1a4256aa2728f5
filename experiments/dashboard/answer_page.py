"""The main job's dashboard: one HTML page that opens with the answer.

It reads what ``pipemare study default`` wrote (``results.json``) and shows, first, the verdict
in a user's words, then per task the validation metric against pipeline time (pipemare and
uncorrected async at the default N, gpipe at the same N, 1F1B at its fastest N, each seed a
line), the schedules ranked by time to 1F1B's quality, and each stage's delay. Every figure
and table names the schedule, its N and the rate.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from pipemare.experiments.studies.grid import Job, load_result
from pipemare.experiments.studies.main_job import schedule_series
from pipemare.experiments.studies.user_protocol import gap_text

__all__ = ["ranked_rows", "stored_table", "write_answer_page"]

#: a colour per schedule, the same in every figure
COLORS = {"pipemare": "#2ca02c", "1f1b": "#1f77b4", "gpipe": "#7f7f7f", "async": "#ff7f0e"}


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _jobs(name: str, task: dict[str, Any], key: tuple, seeds: int) -> list[Job]:
    schedule, p, n = key
    return [Job(name, schedule, p, n, task["rate"], s, None) for s in range(seeds)]


def curve_plot(study: Path, out: Path, results: dict[str, Any]) -> Path:
    """Validation metric against pipeline time, a panel per task and P, a line per seed."""
    panels = [(name, p) for name, task in results["tasks"].items() for p in task["stages"]]
    seeds = int(results["seeds"])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.4), squeeze=False)
    for ax, (name, p) in zip(axes[0], panels, strict=True):
        task = results["tasks"][name]
        finite = []
        for schedule, n, row, key in schedule_series(task, p):
            for seed, job in enumerate(_jobs(name, task, key, seeds)):
                run = load_result(study, job)
                ax.plot(
                    [s * row["step_time_s"] for s in run.steps],
                    run.metric,
                    color=COLORS[schedule],
                    lw=2.2 if schedule == "pipemare" else 1.3,
                    marker="o",
                    ms=2.5,
                    alpha=0.85,
                    label=f"{schedule}, N = {n}" if seed == 0 else None,
                )
                finite += [v for v in run.metric[len(run.metric) // 4 :] if math.isfinite(v)]
        ax.axhline(task["target"], color="black", lw=0.8, ls=":", label="1F1B's quality (1%)")
        ax.set_xlabel(f"pipeline time (s) on {p} devices, replayed from measured action times")
        ax.set_ylabel(task["metric"])
        ax.set_title(
            f"{name} ({task.get('regime') or 'regime not measured'}), P = {p}, "
            f"rate {task['rate']:g} for all (one device's)",
            fontsize=10,
        )
        if finite:  # the first points' values would hide the gaps at the end
            low, high = min(finite), max(finite)
            pad = 0.1 * (high - low) or 0.01 * abs(high)
            ax.set_ylim(low - pad, high + pad)
        ax.legend(fontsize=8)
    return _save(fig, out / "quality_vs_time.png")


def delay_plot(out: Path, results: dict[str, Any]) -> Path:
    """Each stage's mean forward delay, in optimiser steps, of every schedule at its N, per
    task (the engine's staleness is these delays by construction)."""
    from pipemare.schedule.delay import derive_delays

    names = list(results["tasks"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        task = results["tasks"][name]
        for p in task["stages"]:
            series = schedule_series(task, p)
            width = 0.8 / len(series)
            for i, (schedule, n, _, _) in enumerate(series):
                delays = [d.forward for d in derive_delays(schedule, int(p), n)]
                ax.bar(
                    [s + i * width for s in range(len(delays))],
                    delays,
                    width,
                    color=COLORS[schedule],
                    label=f"{schedule}, N = {n}",
                )
            ax.set_xticks([s + 0.4 - width / 2 for s in range(int(p))])
            ax.set_xticklabels([f"stage {s}" for s in range(int(p))])
        ax.set_ylabel("weight staleness (optimiser steps)")
        ax.set_title(f"{name}: staleness per stage", fontsize=10)
        ax.legend(fontsize=8)
    return _save(fig, out / "staleness.png")


def _quality(value: float, spread: float, higher: bool) -> str:
    return "—" if not math.isfinite(value) else f"{value:.3f} ± {spread:.3f}"


def _steps(steps: float) -> str:
    return "never" if not math.isfinite(steps) else f"{steps:.0f}"


def ranked_rows(task: dict[str, Any]) -> list[list[str]]:
    """Each schedule's row at each P, ranked by time to 1F1B's quality (never last), then by
    final quality."""
    higher = task["higher_is_better"]
    rows = []
    for p in task["stages"]:
        for schedule, n, row, _ in schedule_series(task, p):
            ratio = row["time_vs_1f1b"]
            final = row["final"]
            rank = (ratio if math.isfinite(ratio) else math.inf, -final if higher else final)
            rows.append(
                (
                    rank,
                    [
                        p,
                        schedule,
                        str(n),
                        f"{task['rate']:g}",
                        _quality(final, row.get("spread", 0.0), higher),
                        gap_text(final, task["final_1f1b"], higher),
                        _steps(row["steps_to_target"]),
                        f"{1e3 * row['step_time_s']:.1f}",
                        "never" if not math.isfinite(ratio) else f"{ratio:.2f}",
                    ],
                )
            )
    return [cells for _, cells in sorted(rows, key=lambda r: (r[1][0], r[0]))]


HEADER = [
    "P",
    "schedule",
    "N",
    "rate",
    "final quality (± half-range over seeds)",
    "vs 1F1B",
    "steps to 1F1B's quality",
    "ms per step",
    "time to 1F1B's quality vs 1F1B",
]


STORED_HEADER = [
    "study",
    "steps",
    "rate",
    "P",
    "pipemare vs 1F1B at equal steps (± half-range over seeds)",
    "time to 1F1B's quality vs 1F1B",
    "pipemare's step vs 1F1B's (one sitting's range)",
    "uncorrected async vs 1F1B",
]


def _reach(cell: dict[str, Any]) -> str:
    if cell["time_vs_1f1b"] is not None:
        return f"{cell['time_vs_1f1b']:.2f}x"
    return "not timed" if cell["reaches"] else "never"


def _stored_cells(row: dict[str, Any]) -> list[str]:
    pm, asy = row["pipemare"], row["async"]
    step = row["step"]
    return [
        row["task"],
        f"{row['steps']:,}",
        f"{row['rate']:g}" + ("" if row["task_rate"] else " (re-tuned)"),
        str(row["P"]),
        f"{100 * pm['gap']:+.1f}% ± {100 * pm['spread']:.1f}% ({pm['seeds']} seeds)",
        _reach(pm),
        "-" if step is None else f"{step[0]:.2f}x ({step[1]:.2f}-{step[2]:.2f})",
        "-"
        if asy is None
        else f"{100 * asy['gap']:+.1f}%" + ("" if asy["reaches"] else " (never reaches it)"),
    ]


def stored_table(results: dict[str, Any]) -> list[str]:
    """The stored longer study as one table under the fresh answer's curves, labelled as stored,
    with the file and command behind each of its studies (nothing where none was stored)."""
    rows = results.get("stored_rows") or []
    if not rows:
        return []
    sources = sorted({(r["task"], r["source"], r["command"]) for r in rows})
    return [
        "<h2>Stored, not run now: a longer study</h2>",
        "<p class='note'>Every stage simulated in one process; pipemare and uncorrected async at "
        "N = P against 1F1B at its fastest N; time from step times replayed from the timing "
        "sittings. "
        + "; ".join(
            f"{html.escape(t)}: <code>{html.escape(src)}</code>, <code>{html.escape(cmd)}</code>"
            for t, src, cmd in sources
        )
        + ".</p>",
        "<table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in STORED_HEADER)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _stored_cells(r)) + "</tr>"
            for r in rows
        )
        + "</table>",
    ]


def write_answer_page(study: Path, out: Path | None = None) -> Path:
    """Write ``out/index.html`` (default ``study/dashboard``) from ``study/results.json``;
    return its path."""
    results_path = study / "results.json"
    if not results_path.exists():
        raise ValueError(f"{results_path} does not exist: run `pipemare study default` first")
    results = json.loads(results_path.read_text())
    out = out or study / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>pipemare: does it reach your quality sooner than 1F1B?</title>",
        "<style>body{font-family:sans-serif;margin:1.5em 2em;max-width:1500px}"
        "table{border-collapse:collapse;font-size:13px;margin-bottom:1em}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}"
        "li{margin-bottom:.4em}img{max-width:100%}.note{color:#555;font-size:13px}</style>",
        "</head><body>",
        "<h1>Does pipemare reach your quality sooner than 1F1B?</h1>",
        "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in results["answer"]) + "</ul>",
        "<p class='note'>Every schedule at the rate tuned on one device; pipemare and async at "
        "the strategy's default N, gpipe at the same N, 1F1B at its fastest N (its curve per "
        "step is gpipe's). Pipeline time: each configuration's actions timed once, alone, and "
        "replayed through its schedule; no clock was read while the runs trained. "
        f"{results['seeds']} seeds per run. The full protocol: "
        "<code>pipemare user-protocol</code>.</p>",
    ]
    parts.append(_img(curve_plot(study, out, results), "quality against pipeline time"))
    parts += stored_table(results)
    for name, task in results["tasks"].items():
        regime = task.get("regime") or "regime not measured"
        parts.append(f"<h2>{html.escape(name)} ({html.escape(regime)}), ranked</h2>")
        parts.append(
            "<table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
            + "</tr>"
            + "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in ranked_rows(task)
            )
            + "</table>"
        )
    parts.append("<h2>Staleness per stage</h2>")
    parts.append(_img(delay_plot(out, results), "staleness per stage"))
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page
