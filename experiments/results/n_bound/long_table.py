"""The 800-step table of ``long_runs.py``: each cell's seeds against one device's seed-mean
final loss at equal steps, the reach of 1% of it (per seed and on the seed-mean curve), and
time to target from the step times ``times.py`` measured alone for the 400-step study (the
same configurations; a step does not depend on the run's length): reach step × step, over
1F1B's at its fastest N, whose curve per step is one device's.

    python experiments/results/n_bound/long_table.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
TASK = "char_gpt@adamw"
WITHIN = 0.01


def _reach(steps: list[int], curve: list[float], target: float) -> int | None:
    return next((s for s, v in zip(steps, curve, strict=True) if v <= (1 + WITHIN) * target), None)


def main() -> None:
    runs: dict[tuple[str, int, int], list[dict]] = {}
    for path in sorted((HERE / "long" / "runs").glob("*.json")):
        r = json.loads(path.read_text())
        runs.setdefault((r["schedule"], r["stages"], r["microbatches"]), []).append(r)
    sittings = [json.loads(p.read_text()) for p in sorted(HERE.glob("step_times-*.json"))]
    times = {k: statistics.median(s[k] for s in sittings if k in s) for s in sittings for k in s}
    base = runs.pop(("gpipe", 2, 1))
    steps = base[0]["steps"]

    def mean_curve(rs: list[dict]) -> list[float]:
        return [statistics.fmean(r["metric"][i] for r in rs) for i in range(len(steps))]

    target = statistics.fmean(r["metric"][-1] for r in base)
    base_reach = _reach(steps, mean_curve(base), target)
    finals = ", ".join(f"{r['metric'][-1]:.4f}" for r in base)
    print(f"One device (gpipe, N = 1; {len(base)} seeds): {finals}, mean {target:.4f}, its")
    print(f"seed-mean curve within 1% from step {base_reach}.\n")
    print(
        "| P | N | seeds' final loss | mean vs one device (± half-range) | step within 1%, "
        "per seed | on the seed-mean curve | step × 1F1B's (N*) | time to target × 1F1B's |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (_, p, n), rs in sorted(runs.items()):
        fin = [r["metric"][-1] for r in rs]
        per = [_reach(steps, r["metric"], target) for r in rs]
        reach = _reach(steps, mean_curve(rs), target)
        ones = {k: v for k, v in times.items() if k.startswith(f"{TASK}-1f1b-P{p}-N")}
        star = min(ones.values())
        step = times[f"{TASK}-pipemare-P{p}-N{n}"]
        when = "never" if reach is None else f"{reach * step / (base_reach * star):.2f}"
        gap, spread = statistics.fmean(fin) / target - 1, (max(fin) - min(fin)) / 2 / target
        print(
            f"| {p} | {n} | {', '.join(f'{x:.4f}' for x in fin)} | {gap:+.2%} (±{spread:.2%}) | "
            f"{', '.join('never' if x is None else str(x) for x in per)} | "
            f"{'never' if reach is None else reach} | {step / star:.2f} | {when} |"
        )


if __name__ == "__main__":
    main()
