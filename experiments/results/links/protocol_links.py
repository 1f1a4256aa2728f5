"""The user protocol's tasks over links between the stages (issue 62, item 4).

The protocol's tables (``experiments/results/user_protocol``, ``user_protocol_c64``) give each
task's steps to target with communication free. This replays the same per-action timings
over links: every link of the pipeline the given one, each microbatch's activations and
gradients crossing it, overlapped with compute where the schedule has other work
(:func:`pipemare.experiments.studies.protocol.step_times`). For each task and P: 1F1B at every
N the protocol times it at, and the default pipemare (N as the strategy picks it). 1F1B takes
its fastest N over each link; each schedule's time to target is its steps to target (the
protocol's, from ``results.json``: link-free, since a link changes when a step ends, not what
it computes) times its step over that link. Each task is labelled by its regime, measured here
with the step times (``cost_per_row.json``; ``user_protocol.regime``: compute-bound where its
smallest microbatch costs at most 1.25x per row what its whole batch does). Run it alone on
the machine (the durations are measured)::

    python experiments/results/links/protocol_links.py measure --gloo-link 25Gb/s@120us
    python experiments/results/links/protocol_links.py summary   # time to target x 1F1B's
    python experiments/results/links/protocol_links.py table     # every configuration

``measure`` takes a task's configurations' windows in turn
(:func:`~pipemare.experiments.studies.protocol.interleaved_step_times`), keeps what it found in
``protocol_step_times.json`` and ``cost_per_row.json`` and skips what is there
(``protocol_step_times-one-after-another.json``: the first measurement, one configuration
after another, before 2026-12-01).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

_HERE = Path(__file__).parent
_ROOT = _HERE.parent
RESULTS = (_ROOT / "user_protocol" / "results.json", _ROOT / "user_protocol_c64" / "results.json")
TIMES = _HERE / "protocol_step_times.json"
#: each task's whole model, forward and backward, seconds per row at each microbatch size run
COSTS = _HERE / "cost_per_row.json"
#: the simulated links every column but the measured one replays
LINKS = ("10Gb/s@20us", "1Gb/s@1ms")
STAGES = (2, 4, 8)


def _tasks() -> dict[str, dict[str, Any]]:
    tasks: dict[str, dict[str, Any]] = {}
    for path in RESULTS:
        tasks |= json.loads(path.read_text())["tasks"]
    return tasks


def _keys(name: str) -> list[tuple[str, int, int]]:
    """The protocol's own timed configurations (``user_protocol._time_keys``) that the link
    columns need: 1F1B at every N and the default pipemare."""
    from pipemare.experiments.studies.user_protocol import _time_keys

    return [k for k in _time_keys(name, False, STAGES) if k[0] in ("1f1b", "pipemare")]


def _measure(gloo_link: str) -> None:
    import torch

    from pipemare.engine.link import Link
    from pipemare.experiments.studies.protocol import TASKS, interleaved_step_times
    from pipemare.experiments.studies.user_protocol import measure_cost_per_row

    measure_cost_per_row(_HERE, list(_tasks()), stages=STAGES)
    torch.set_num_threads(1)  # one core per stage's work, as the runs train
    links = {name: Link.parse(name) for name in LINKS}
    links[f"gloo (measured: {gloo_link})"] = Link.parse(gloo_link)
    times: dict[str, dict[str, float]] = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    for name in _tasks():
        todo = [
            (v, p, n)
            for v, p, n in _keys(name)
            if not all(link in times.get(f"{name}-{v}-P{p}-N{n}", {}) for link in links)
        ]
        found = interleaved_step_times(TASKS[name], todo, None, 12, 8, 3, links)
        for (v, p, n), by_link in found.items():
            times[f"{name}-{v}-P{p}-N{n}"] = by_link
            print(name, v, p, n, {k: round(1e3 * s, 2) for k, s in by_link.items()}, flush=True)
        TIMES.write_text(json.dumps(times, indent=1, sort_keys=True))


def _default_row(rows: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
    for row in rows:
        if row["N"] == n and row["schedule"] in ("pipemare", "pipemare (default N)"):
            return row
    return None


def _regimes() -> dict[str, str]:
    """Each task's regime as measured here ("not measured" before ``measure``)."""
    from pipemare.experiments.studies.user_protocol import regime

    costs = json.loads(COSTS.read_text()) if COSTS.exists() else {}
    return {
        name: regime({int(rows): s for rows, s in costs[name].items()})
        if name in costs
        else "not measured"
        for name in _tasks()
    }


def _rows() -> list[dict[str, Any]]:
    """Per task, P and link: the task's regime, 1F1B's fastest N and step, pipemare's step, and
    pipemare's time to target as a share of 1F1B's (None: never within the run)."""
    times: dict[str, dict[str, float]] = json.loads(TIMES.read_text())
    regimes = _regimes()
    out = []
    for name, task in _tasks().items():
        for p in STAGES:
            stage = task["stages"].get(str(p))
            own_key = next(
                (f"{name}-{v}-P{p}-N{n}" for v, q, n in _keys(name) if v == "pipemare" and q == p),
                None,
            )
            if stage is None or own_key is None or own_key not in times:
                continue
            n_own = int(own_key.rsplit("N", 1)[1])
            row = _default_row(stage["rows"], n_own)
            if row is None:
                continue
            base_steps = stage["1f1b"]["steps_to_target"]
            for link in [k for k in times[own_key] if k != "free"] + ["free"]:
                base = {
                    n: times[f"{name}-1f1b-P{p}-N{n}"][link]
                    for v, q, n in _keys(name)
                    if v == "1f1b" and q == p and f"{name}-1f1b-P{p}-N{n}" in times
                }
                n_star = min(base, key=lambda n: (base[n], n))
                own = times[own_key][link]
                steps = row["steps_to_target"]
                ratio = (
                    None if not math.isfinite(steps) else steps * own / (base_steps * base[n_star])
                )
                out.append(
                    {
                        "task": name,
                        "regime": regimes[name],
                        "P": p,
                        "link": link,
                        "1f1b_n": n_star,
                        "1f1b_ms": 1e3 * base[n_star],
                        "N": n_own,
                        "pipemare_ms": 1e3 * own,
                        "steps": steps,
                        "base_steps": base_steps,
                        "time_vs_1f1b": ratio,
                    }
                )
    return out


def _table() -> str:
    lines = [
        "| task | regime | P | link | 1F1B's N, step | pipemare's N, step | step ratio | "
        "steps to target (pipemare / 1F1B) | time to target × 1F1B's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _rows():
        steps = "never" if not math.isfinite(r["steps"]) else f"{r['steps']:.0f}"
        time = "never" if r["time_vs_1f1b"] is None else f"{r['time_vs_1f1b']:.2f}"
        lines.append(
            f"| {r['task']} | {r['regime']} | {r['P']} | {r['link']} | "
            f"{r['1f1b_n']}, {r['1f1b_ms']:.1f} ms | {r['N']}, {r['pipemare_ms']:.1f} ms | "
            f"{r['pipemare_ms'] / r['1f1b_ms']:.2f} | "
            f"{steps} / {r['base_steps']:.0f} | {time} |"
        )
    return "\n".join(lines)


def _summary() -> str:
    """Per task and P, pipemare's time to target as a share of 1F1B's over each link."""
    found = _rows()
    links = list(dict.fromkeys(r["link"] for r in found))
    cells: dict[tuple[str, str, int], dict[str, str]] = {}
    for r in found:
        time = "never" if r["time_vs_1f1b"] is None else f"{r['time_vs_1f1b']:.2f}"
        cells.setdefault((r["task"], r["regime"], r["P"]), {})[r["link"]] = time
    lines = [
        "| task | regime | P | " + " | ".join(links) + " |",
        "|---|---|---|" + "---|" * len(links),
    ]
    for (task, regime, p), by_link in cells.items():
        lines.append(
            f"| {task} | {regime} | {p} | " + " | ".join(by_link.get(k, "") for k in links) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure", help="time every configuration over the links (alone)")
    m.add_argument("--gloo-link", required=True, help="the link measured between two processes")
    sub.add_parser("table", help="the Markdown table, every configuration")
    sub.add_parser("summary", help="pipemare's time to target x 1F1B's, per task, P and link")
    args = parser.parse_args()
    if args.what == "measure":
        _measure(args.gloo_link)
    else:
        print(_table() if args.what == "table" else _summary())


if __name__ == "__main__":
    main()
