"""``pipemare compare RUN_DIR...``: one self-contained HTML page (and PNGs) comparing runs.

It finds every run (a directory with ``summary.json``) under the given directories and shows,
per task: the runs ranked by their best monitored value with each one's gap to gpipe, the
monitored metric and the training loss against steps and against pipeline time (what P
devices take: per-action times measured once replayed through the schedule, the same in
every study; the clock's readings, which are not, in a table of their own), the delays per
stage (derived and measured), utilisation and weight discrepancy per stage ("n/a" where a
stage logged none), and memory (weights, optimiser state, PipeDream's stash, correction
buffers, activations held).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from pipemare.experiments._commands import command_parser
from pipemare.experiments.dashboard.plots import (
    bars_plot,
    convergence_plot,
    memory_plot,
    staleness_plot,
)
from pipemare.experiments.dashboard.runs import Run, find_runs
from pipemare.experiments.dashboard.tables import (
    answer,
    markdown_table,
    measured_table,
    results_table,
)


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.stem)}">'


def _claim(out: Path, paths: list[Path]) -> None:
    """Make ``out`` this comparison's: refuse a directory that holds another one's dashboard."""
    sources = sorted(str(p.resolve()) for p in paths)
    record = out / "sources.json"
    if record.exists() and json.loads(record.read_text()) != sources:
        raise ValueError(
            f"{out} holds the dashboard of {', '.join(json.loads(record.read_text()))}; "
            "write this comparison elsewhere with --out DIR"
        )
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(sources))


def default_out(paths: list[Path]) -> Path:
    """One study: its own ``dashboard/``; several: ``compare-A-B`` beside the first of them."""
    if len(paths) == 1:
        return paths[0] / "dashboard"
    return paths[0].resolve().parent / ("compare-" + "-".join(p.resolve().name for p in paths))


def write_dashboard(paths: list[Path], out: Path) -> Path:
    """Write ``out/index.html``, the PNGs and ``out/results.md``; return the HTML path."""
    runs = find_runs(paths)
    if not runs:
        raise ValueError(
            f"no finished runs (directories with summary.json) under {', '.join(map(str, paths))}"
        )
    _claim(out, paths)
    tasks: dict[str, list[Run]] = {}
    for run in runs:
        tasks.setdefault(run.task, []).append(run)
    header, rows = results_table(runs)
    summary = "".join(f"- {line}\n" for line in answer(runs))
    (out / "results.md").write_text(summary + "\n" + markdown_table(header, rows))
    measured_header, measured_rows = measured_table(runs)
    (out / "measured.md").write_text(markdown_table(measured_header, measured_rows))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pipemare: runs compared</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}"
        "img{max-width:100%}"
        ".diverged{color:#b00}</style></head><body>",
        f"<h1>pipemare: {len(runs)} runs compared</h1>",
        "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in answer(runs)) + "</ul>",
        "<p>Runs ranked within each task by their best monitored value; the gap to gpipe is "
        "best minus gpipe's best at the same stages and microbatches (for a loss, positive is "
        "worse). Pipeline time is what P devices take: each layout's per-action times, "
        "measured once before the runs, replayed through its schedule (a run without them: "
        "its monitor's clock). What the clock read during the runs is in the last table.</p>",
        "<h2>Results</h2><table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in header)
        + "</tr>",
    ]
    for r in rows:
        cls = ' class="diverged"' if r[-1] != "complete" else ""
        parts.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
    parts.append("</table>")
    parts.append(
        "<h2>Measured on this machine</h2><p>What the clock read while each run trained: it "
        "differs from one run to the next, and nothing above depends on it.</p><table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in measured_header)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
            for r in measured_rows
        )
        + "</table>"
    )
    for task, task_runs in tasks.items():
        parts.append(f"<h2>{html.escape(task)}</h2>")
        charts = [
            convergence_plot(task, task_runs, out),
            staleness_plot(task, task_runs, out),
            bars_plot(
                task, task_runs, out, "utilization", "utilisation", f"{task}_utilization.png"
            ),
            bars_plot(
                task,
                task_runs,
                out,
                "discrepancy",
                "weight discrepancy ||w_fwd - w_bkwd|| / ||w||",
                f"{task}_discrepancy.png",
            ),
            memory_plot(task, task_runs, out),
        ]
        parts += [_img(c) for c in charts if c is not None]
        for run in task_runs:
            if run.summary.get("divergence"):
                parts.append(
                    f"<p class='diverged'>{html.escape(run.variant)}: "
                    f"{html.escape(run.summary['divergence'])}</p>"
                )
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pipemare compare", __doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run or study directories")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write (default: RUNS/dashboard for one study, compare-A-B beside several)",
    )
    args = parser.parse_args(argv)
    try:
        page = write_dashboard(args.runs, args.out or default_out(args.runs))
    except ValueError as error:
        parser.error(str(error))
    print(f"dashboard: {page}")
