"""The links check's tables from ``results.jsonl`` (written by ``sitting.sh``): per model and
link, the advice's replayed steps against the measured ones, median over the sittings.

    python experiments/results/links/table.py                   # every sitting (Markdown)
    python experiments/results/links/table.py --sittings 4 5 6  # those sittings only
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

_HERE = Path(__file__).parent
_REGIME = {(192, 8, 64): "compute-bound", (64, 4, 32): "dispatch-bound"}


def rows(path: Path = _HERE / "results.jsonl", sittings: set[int] | None = None) -> list[str]:
    """The table's lines, over ``sittings`` (every one where None)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if sittings is None or r["sitting"] in sittings]
    # per (model, link, sitting): the pipemare run (with the advice) and the 1F1B run
    runs: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        key = ((r["width"], r["layers"], r["context"]), r["link"], r["sitting"])
        runs[key][r["schedule"]] = r
    cells: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    for (model, link, _), pair in sorted(runs.items()):
        own, base = pair.get("pipemare"), pair.get("1f1b")
        if own is None or base is None or "predicted_ms" not in own:
            continue
        predicted_base = own["baseline_predicted_ms"][str(base["N"])]
        cells[model, link].append(
            {
                "own_pred": own["predicted_ms"],
                "own_meas": own["step_ms"],
                "base_pred": predicted_base,
                "base_meas": base["step_ms"],
                "n": base["N"],
                "ratio_pred": own["predicted_ms"] / predicted_base,
                "ratio_meas": own["step_ms"] / base["step_ms"],
            }
        )
    out = [
        "| model | link | sittings | 1F1B's N | pipemare step: replayed / measured (error) | "
        "1F1B step: replayed / measured (error) | step ratio: predicted / measured (error) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, link), found in cells.items():
        med = {k: statistics.median(f[k] for f in found) for k in found[0]}
        spread = {
            k: (min(f[k] for f in found), max(f[k] for f in found))
            for k in ("own_meas", "base_meas", "ratio_meas")
        }

        def err(pred: float, meas: float) -> str:
            return f"{100 * (pred / meas - 1):+.0f}%"

        out.append(
            f"| {_REGIME.get(model, model)} {model} | {link} | {len(found)} | "
            f"{', '.join(str(f['n']) for f in found)} | "
            f"{med['own_pred']:.1f} / {med['own_meas']:.1f} ms "
            f"({spread['own_meas'][0]:.1f}-{spread['own_meas'][1]:.1f}) "
            f"({err(med['own_pred'], med['own_meas'])}) | "
            f"{med['base_pred']:.1f} / {med['base_meas']:.1f} ms "
            f"({spread['base_meas'][0]:.1f}-{spread['base_meas'][1]:.1f}) "
            f"({err(med['base_pred'], med['base_meas'])}) | "
            f"{med['ratio_pred']:.2f} / {med['ratio_meas']:.2f} "
            f"({err(med['ratio_pred'], med['ratio_meas'])}) |"
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the links check's table")
    parser.add_argument("--sittings", type=int, nargs="+", help="only these sittings")
    args = parser.parse_args()
    print("\n".join(rows(sittings=set(args.sittings) if args.sittings else None)))
