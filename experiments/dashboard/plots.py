"""The dashboard's figures: quality against steps and pipeline time, delays, utilisation and memory
per stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pipemare.experiments.dashboard.runs import BASE_VARIANTS, Run, memory_mb

#: a colour per variant, in the order of :data:`BASE_VARIANTS`
_COLORS = dict(
    zip(
        BASE_VARIANTS,
        ("#1f77b4", "#17becf", "#9467bd", "#d62728", "#000000", "#ff7f0e", "#2ca02c"),
        strict=True,
    )
)


def _color(run: Run) -> str | None:
    return None if run.base_variant is None else _COLORS[run.base_variant]


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
    if all(run.summary.get("step_s") for run in runs):
        return (lambda run, steps: run.pipeline_time(steps)), (
            "pipeline time (s) on P devices, action times measured once and replayed"
        )
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


def convergence_plot(task: str, runs: list[Run], out: Path) -> Path:
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


def staleness_plot(task: str, runs: list[Run], out: Path) -> Path | None:
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


def bars_plot(
    task: str, runs: list[Run], out: Path, metric: str, label: str, file: str
) -> Path | None:
    values = [(run, run.last_stage_values(metric)) for run in runs]
    values = [(r, v) for r, v in values if v and not all(np.isnan(v))]
    if not values:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(values)
    for j, (run, v) in enumerate(values):
        x = np.arange(len(v)) + j * width
        ax.bar(x, v, width, color=_color(run), label=f"{run.variant} (mean {np.nanmean(v):.2g})")
        for xi in x[np.isnan(v)]:  # a stage that logged none: say so rather than show nothing
            ax.text(xi, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xlabel("stage")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{task}: {label} per stage")
    return _save(fig, out / file)


def memory_plot(task: str, runs: list[Run], out: Path) -> Path | None:
    rows = [(run, run.summary.get("memory", {}).get("stages", [])) for run in runs]
    rows = [(r, s) for r, s in rows if s]
    if not rows:
        return None
    parts = ["weights_mb", "optimizer_state_mb", "stash_mb", "correction_buffers_mb"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    bottom = np.zeros(len(rows))
    for part in parts:
        values = np.array([sum(memory_mb(s, part) for s in stages) for _, stages in rows])
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
