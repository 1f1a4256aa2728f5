"""``pipemare compare RUN_DIR...``: one self-contained HTML page (and PNGs) comparing runs.

It finds every run (a directory with ``summary.json``) under the given directories and shows,
per task: the runs ranked by their best monitored value with each one's gap to gpipe, the
monitored metric and the training loss against steps and against pipeline time (what P
devices take; replayed from measured action times for stages simulated in one process, whose
own serial wall time is shown apart and labelled as such), the delays per stage (derived and
measured), utilisation per stage, and memory (weights, optimiser state, PipeDream's stash,
correction buffers, activations held).
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import yaml

__all__ = ["Run", "answer", "find_runs", "main", "ranked", "results_table", "write_dashboard"]

_COLORS = {
    "gpipe": "#1f77b4",
    "1f1b": "#17becf",
    "pipedream": "#9467bd",
    "async": "#d62728",
    "pipemare": "#000000",
    "pipemare-T1T2": "#ff7f0e",
    "pipemare-T1T2T3": "#2ca02c",
}


@dataclasses.dataclass
class Run:
    """One finished run: its directory, what it was, and what it logged."""

    path: Path
    name: str
    task: str
    variant: str
    monitor: str
    mode: str
    summary: dict[str, Any]
    config: dict[str, Any]
    rows: list[dict[str, str]]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of a logged metric."""
        points = [
            (float(r["step"]), float(r[key])) for r in self.rows if r.get(key) not in (None, "")
        ]
        if not points:
            return np.zeros(0), np.zeros(0)
        steps, values = zip(*points, strict=True)
        return np.array(steps), np.array(values)

    def wall_time(self, steps: np.ndarray) -> np.ndarray:
        """Seconds since fit started at each of ``steps`` (interpolated from logged wall time)."""
        s, t = self.series("pipemare/wall_time")
        if len(s) == 0:
            return steps * self.summary["wall_time_s"] / max(self.summary["global_step"], 1)
        return np.interp(steps, np.concatenate([[0.0], s]), np.concatenate([[0.0], t]))

    @property
    def simulated(self) -> bool:
        """Its stages ran one after another in one process (its wall time is serial); False
        where no ``PipelineMonitor`` said so."""
        _, flags = self.series("pipemare/simulated")  # logged by the PipelineMonitor
        return bool(len(flags)) and bool(flags[-1])

    def pipeline_time(self, steps: np.ndarray) -> np.ndarray | None:
        """Seconds P devices take to reach each of ``steps`` (``PipelineMonitor``'s clock:
        measured with a process per stage, replayed for simulated stages); None if not logged."""
        s, t = self.series("pipemare/pipeline_time")
        if len(s) == 0:
            return None
        # the clock is logged every few steps; extrapolate the last rate to the run's end
        rate = t[-1] / s[-1] if s[-1] > 0 else 0.0
        xs = np.concatenate([[0.0], s, [max(float(steps.max(initial=0)), s[-1]) + 1]])
        ts = np.concatenate([[0.0], t, [t[-1] + rate * (xs[-1] - s[-1])]])
        return np.interp(steps, xs, ts)

    @property
    def total_pipeline_time(self) -> float | None:
        steps = np.array([float(self.summary.get("global_step", 0))])
        t = self.pipeline_time(steps)
        return None if t is None else float(t[0])

    @property
    def lr(self) -> float | None:
        try:
            return float(self.config["model"]["init_args"]["optimizer"]["init_args"]["lr"])
        except (KeyError, TypeError):
            return None

    def last_stage_values(self, name: str) -> list[float]:
        stages = self.summary.get("stages") or 0
        values = []
        for i in range(stages):
            _, v = self.series(f"pipemare/stage{i}/{name}")
            values.append(float(v[-1]) if len(v) else float("nan"))
        return values


def find_runs(paths: list[Path]) -> list[Run]:
    runs = []
    for root in paths:
        for summary_path in sorted(root.rglob("summary.json")):
            d = summary_path.parent
            spec = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
            summary = json.loads(summary_path.read_text())
            config = (
                yaml.safe_load((d / "config.yaml").read_text())
                if (d / "config.yaml").exists()
                else {}
            )
            metrics = d / "csv" / "metrics.csv"
            if not metrics.exists():  # studies before pipemare 0.2 logged beside config.yaml
                metrics = d / "metrics.csv"
            rows = list(csv.DictReader(metrics.open())) if metrics.exists() else []
            name = spec.get("name", d.name)
            task = spec.get("task", name.split("-", 1)[0])
            variant = name[len(task) + 1 :] if name.startswith(task + "-") else name
            runs.append(
                Run(
                    d,
                    name,
                    task,
                    variant,
                    summary["monitor"],
                    summary["mode"],
                    summary,
                    config,
                    rows,
                )
            )
    return runs


def _color(run: Run) -> str | None:
    base = run.variant.split("-P")[0].split("-lr")[0].split("-N")[0]
    for key in sorted(_COLORS, key=len, reverse=True):
        if base.endswith(key):
            return _COLORS[key]
    return None


def _smooth(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return np.array(out)


def _save(fig: Any, path: Path, layout: bool = True) -> Path:
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing clipped: labels, outside legends
    plt.close(fig)
    return path


def _time_axis(runs: list[Run]) -> tuple[Any, str]:
    """The time each run is plotted against: pipeline time where every run logged it, else
    wall time, labelled serial where a run simulated its stages in one process."""
    if all(run.series("pipemare/pipeline_time")[0].size for run in runs):
        simulated = any(run.simulated for run in runs)
        label = "pipeline time (s) on P devices" + (
            ", replayed from measured action times" if simulated else ""
        )
        return (lambda run, steps: run.pipeline_time(steps)), label
    label = "wall time (s)" + (
        ", serial: simulated stages ran one after another" if any(r.simulated for r in runs) else ""
    )
    return (lambda run, steps: run.wall_time(steps)), label


def _convergence(task: str, runs: list[Run], out: Path) -> Path:
    monitor = runs[0].monitor
    clock, time_label = _time_axis(runs)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for run in runs:
        kw = {"label": run.variant, "color": _color(run)}
        s, v = run.series(monitor)
        axes[0, 0].plot(s, v, marker="o", ms=3, **kw)
        axes[0, 1].plot(clock(run, s), v, marker="o", ms=3, **kw)
        s, v = (
            run.series("train_loss_step")
            if len(run.series("train_loss_step")[0])
            else run.series("train_loss")
        )
        axes[1, 0].plot(s, _smooth(v), **kw)
        axes[1, 1].plot(clock(run, s), _smooth(v), **kw)
    for ax, (y, x) in zip(
        axes.flat,
        [
            (monitor, "step"),
            (monitor, time_label),
            ("train loss (smoothed)", "step"),
            ("train loss (smoothed)", time_label),
        ],
        strict=True,
    ):
        ax.set_xlabel(x, fontsize=9)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=min(len(labels), 7),
        fontsize=8,
        bbox_to_anchor=(0.5, 0.955),
        frameon=False,
    )
    fig.suptitle(f"{task}: convergence")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, out / f"{task}_convergence.png", layout=False)


def _staleness(task: str, runs: list[Run], out: Path) -> Path | None:
    runs = [r for r in runs if r.summary.get("tau_fwd")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in runs:
        derived = run.summary["tau_fwd"]
        x = np.arange(len(derived))
        ax.plot(x, derived, color=_color(run), alpha=0.5, label=f"{run.variant} (derived)")
        measured = run.last_stage_values("tau_fwd_measured")
        ax.plot(x, measured, "o", color=_color(run), ms=5, label=f"{run.variant} (measured)")
    ax.set_xlabel("stage")
    ax.set_ylabel("forward delay (updates)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{task}: staleness per stage")
    return _save(fig, out / f"{task}_staleness.png")


def _bars(task: str, runs: list[Run], out: Path, metric: str, label: str, file: str) -> Path | None:
    values = [(run, run.last_stage_values(metric)) for run in runs]
    values = [(r, v) for r, v in values if v and not all(np.isnan(v))]
    if not values:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(values)
    for j, (run, v) in enumerate(values):
        ax.bar(
            np.arange(len(v)) + j * width,
            v,
            width,
            color=_color(run),
            label=f"{run.variant} (mean {np.nanmean(v):.2f})",
        )
    ax.set_xlabel("stage")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{task}: {label} per stage")
    return _save(fig, out / file)


def _mb(stage: dict[str, Any], part: str) -> float:
    # summaries before pipemare 0.2 called the correction buffers "velocity_mb" (T2's only)
    if part == "correction_buffers_mb" and part not in stage:
        return float(stage.get("velocity_mb", 0.0))
    return float(stage[part])


def _memory(task: str, runs: list[Run], out: Path) -> Path | None:
    rows = [(run, run.summary.get("memory", {}).get("stages", [])) for run in runs]
    rows = [(r, s) for r, s in rows if s]
    if not rows:
        return None
    parts = ["weights_mb", "optimizer_state_mb", "stash_mb", "correction_buffers_mb"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    bottom = np.zeros(len(rows))
    for part in parts:
        values = np.array([sum(_mb(s, part) for s in stages) for _, stages in rows])
        ax.bar(
            range(len(rows)),
            values,
            bottom=bottom,
            label=part.removesuffix("_mb").replace("_", " "),
        )
        bottom += values
    ax.set_xticks(
        range(len(rows)), [r.variant for r, _ in rows], rotation=30, ha="right", fontsize=8
    )
    ax.set_ylabel("MB over all stages")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, frameon=False)
    ax.set_title("weight memory")
    for run, stages in rows:
        ax2.plot(
            [s["peak_in_flight"] for s in stages], marker="o", color=_color(run), label=run.variant
        )
    ax2.set_xlabel("stage")
    ax2.set_ylabel("peak microbatches in flight")
    ax2.set_title("activations held (microbatches)")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{task}: memory")
    return _save(fig, out / f"{task}_memory.png")


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _reference(run: Run, runs: list[Run]) -> Run | None:
    """The gpipe run ``run`` is measured against: same task, and the same stages and
    microbatches where such a run exists (else the same stages, else any)."""
    gpipes = [r for r in runs if r.task == run.task and _color(r) == _COLORS["gpipe"]]
    gpipes = [r for r in gpipes if r.summary.get("best") is not None]

    def same(r: Run, *keys: str) -> bool:
        return all(r.summary.get(k) == run.summary.get(k) for k in keys)

    for keys in (("stages", "microbatches"), ("stages",), ()):
        matches = [r for r in gpipes if same(r, *keys)]
        if matches:
            return matches[0]
    return None


def ranked(runs: list[Run]) -> list[Run]:
    """Runs by task (in order of first appearance), best first within a task; runs without a
    best value last."""
    order = {task: i for i, task in reversed(list(enumerate(r.task for r in runs)))}

    def key(run: Run) -> tuple[int, int, float]:
        best = run.summary.get("best")
        if best is None:
            return order[run.task], 1, 0.0
        return order[run.task], 0, -best if run.mode == "max" else best

    return sorted(runs, key=key)


def gap(run: Run, reference: Run | None) -> str:
    """``best − gpipe's best`` with its relative size, signed so that the reader sees the
    direction of the metric (for a loss, positive is worse)."""
    best = run.summary.get("best")
    if reference is None or best is None:
        return "-"
    ref = reference.summary["best"]
    delta = best - ref
    relative = f" ({100 * delta / abs(ref):+.1f}%)" if ref else ""
    return f"{delta:+.3f}{relative}"


def results_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """The final-quality table: one row per run, ranked within each task, with its gap to gpipe."""
    header = [
        "rank",
        "task",
        "run",
        "stages",
        "N",
        "lr",
        "best",
        "gap to gpipe",
        "final",
        "steps to target",
        "pipeline s",
        "wall s",
        "utilisation",
        "stash MB",
        "correction buffers MB",
        "status",
    ]
    rows = []
    rank, task = 0, None
    for run in ranked(runs):
        rank = rank + 1 if run.task == task else 1
        task = run.task
        s = run.summary
        mem = s.get("memory", {}).get("stages", [])
        util = run.last_stage_values("utilization")
        final = s["final"].get(run.monitor)
        wall = _fmt(s.get("wall_time_s"), 0)
        rows.append(
            [
                str(rank),
                run.task,
                run.variant,
                _fmt(s.get("stages")),
                _fmt(s.get("microbatches")),
                _fmt(run.lr, 4),
                f"{run.monitor} {_fmt(s.get('best'))}",
                gap(run, _reference(run, runs)),
                _fmt(final),
                _fmt(s.get("steps_to_target")),
                _fmt(run.total_pipeline_time, 1),
                f"{wall} (serial)" if run.simulated and wall != "-" else wall,
                _fmt(float(np.nanmean(util)) if util and not all(np.isnan(util)) else None, 2),
                _fmt(sum(m["stash_mb"] for m in mem), 2) if mem else "-",
                _fmt(sum(_mb(m, "correction_buffers_mb") for m in mem), 2) if mem else "-",
                s["status"],
            ]
        )
    return header, rows


def answer(runs: list[Run]) -> list[str]:
    """One sentence per task: which run did best, and how each PipeMare run compares to gpipe."""
    lines = []
    tasks: dict[str, list[Run]] = {}
    for run in ranked(runs):
        tasks.setdefault(run.task, []).append(run)
    for task, task_runs in tasks.items():
        scored = [r for r in task_runs if r.summary.get("best") is not None]
        if not scored:
            continue
        top = scored[0]
        text = f"{task}: best {top.monitor} {_fmt(top.summary['best'])} by {top.variant}"
        reference = _reference(top, runs)
        if reference is not None:
            text += f"; gpipe {_fmt(reference.summary['best'])}"
            mares = [r for r in scored if "pipemare" in r.variant]
            text += "".join(f"; {r.variant} {gap(r, _reference(r, runs))}" for r in mares)
        lines.append(text + ".")
    return lines


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


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
    (out / "results.md").write_text(summary + "\n" + _markdown(header, rows))
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
        "worse). Pipeline time is what P devices take: measured with a process per stage, "
        "replayed from the measured action times for stages simulated in one process, whose "
        "wall time is serial (its stages ran one after another) and labelled so. Utilisation of "
        "simulated stages is replayed the same way.</p>",
        "<h2>Results</h2><table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in header)
        + "</tr>",
    ]
    for r in rows:
        cls = ' class="diverged"' if r[-1] != "complete" else ""
        parts.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
    parts.append("</table>")
    for task, task_runs in tasks.items():
        parts.append(f"<h2>{html.escape(task)}</h2>")
        charts = [
            _convergence(task, task_runs, out),
            _staleness(task, task_runs, out),
            _bars(task, task_runs, out, "utilization", "utilisation", f"{task}_utilization.png"),
            _memory(task, task_runs, out),
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
    parser = argparse.ArgumentParser(
        prog="pipemare compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
