"""A run as the dashboard reads it from its directory (summary, metrics, config), and finding runs
under directories.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

#: the schedules and PipeMare variants the studies run, as run names end
BASE_VARIANTS = (
    "gpipe",
    "1f1b",
    "pipedream",
    "async",
    "pipemare",
    "pipemare-T1T2",
    "pipemare-T1T2T3",
)


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
    def base_variant(self) -> str | None:
        """Which of :data:`BASE_VARIANTS` the run is (its variant without a study's ``-P``,
        ``-lr`` or ``-N`` tag); None for another."""
        base = self.variant.split("-P")[0].split("-lr")[0].split("-N")[0]
        for name in sorted(BASE_VARIANTS, key=len, reverse=True):
            if base.endswith(name):
                return name
        return None

    @property
    def simulated(self) -> bool:
        """Its stages ran one after another in one process (its wall time is serial); False
        where no ``PipelineMonitor`` said so."""
        _, flags = self.series("pipemare/simulated")  # logged by the PipelineMonitor
        return bool(len(flags)) and bool(flags[-1])

    def pipeline_time(self, steps: np.ndarray) -> np.ndarray | None:
        """Seconds P devices take to reach each of ``steps``: the run's replayed time per step
        (``step_s`` of its summary: per-action times measured once, the same in every study),
        else ``PipelineMonitor``'s clock (measured with a process per stage, replayed for
        simulated stages; it differs from run to run); None if neither is known."""
        if self.summary.get("step_s"):
            return steps * float(self.summary["step_s"])
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

    def best_until(self, steps: float | None = None, seconds: float | None = None) -> float | None:
        """The best validated value at or before ``steps`` and ``seconds`` of pipeline time (a
        run compared with gpipe at gpipe's steps or at its pipeline time); None if none was."""
        points = [(float(s), float(v)) for s, v in self.summary.get("history") or []]
        if steps is not None:
            points = [(s, v) for s, v in points if s <= steps]
        if seconds is not None and points:
            times = self.pipeline_time(np.array([s for s, _ in points]))
            if times is not None:
                points = [p for p, t in zip(points, times, strict=True) if t <= seconds * 1.000001]
        values = [v for _, v in points if np.isfinite(v)]
        if not values:
            return None
        return max(values) if self.mode == "max" else min(values)

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


def memory_mb(stage: dict[str, Any], part: str) -> float:
    """One stage's ``part`` of its memory summary, in MB."""
    # a summary that names the correction buffers "velocity_mb" counted T2's buffers alone
    if part == "correction_buffers_mb" and part not in stage:
        return float(stage.get("velocity_mb", 0.0))
    return float(stage[part])


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
            if not metrics.exists():  # a study that logged its metrics beside config.yaml
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
