"""Step times for the n_bound tables: each configuration's pipeline seconds per step from its
per-action times, measured once in this process and replayed with each stage on a device of its
own (:func:`pipemare.experiments.studies.protocol.step_times`, communication free; the median of
3 windows of 12 steps after 8, as ``pipemare user-protocol --phase times`` and
experiments/studies/horizon.py ``times`` measure). Per task and P = 2, 4, 8: 1F1B at every N
dividing the batch (its fastest is the baseline), gpipe and uncorrected ``async`` at N = P, and
pipemare at N = P, 2P, 4P where N divides the batch. Written to ``step_times-{SITTING}.json``;
table.py takes each configuration's median over the sittings.

Run it alone on the machine (nothing else training): sittings 1 and 2 ran so (the quality
queue paused with SIGSTOP). Each sitting, then the table:

    S=2 && PYTHONPATH=. OMP_NUM_THREADS=1 WANDB_MODE=disabled \
        python experiments/results/n_bound/times.py --sitting $S && \
      PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/n_bound/cost_per_row.py \
        --sitting $S
    PYTHONPATH=. python experiments/results/n_bound/table.py --readme

(cost_per_row.py's sittings 1 and 2 were measured alone too; the shared machine's earlier
sittings were removed.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import SETUP, cells  # noqa: E402


def _keys(task: str, stages: list[int]) -> list[tuple[str, int, int]]:
    from pipemare.experiments.studies.protocol import TASKS
    from pipemare.experiments.studies.user_protocol import one_f_one_b_ns

    out = []
    for p in stages:
        out += [("1f1b", p, n) for n in one_f_one_b_ns(TASKS[task], p)]
        out.append(("gpipe", p, p))
        out += cells(task, [p])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sitting", type=int, default=1)
    args = parser.parse_args()
    import torch

    from pipemare.experiments.studies.protocol import TASKS, step_times

    torch.set_num_threads(1)  # one core per stage's work, as the runs train
    path = args.out / f"step_times-{args.sitting}.json"
    times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    for task in SETUP:
        for v, p, n in _keys(task, args.stages):
            key = f"{task}-{v}-P{p}-N{n}"
            if key in times:
                continue
            times[key] = step_times(TASKS[task], v, p, n, None, 12, warm=8, repeats=3)["free"]
            print(f"{key}: {1000 * times[key]:.2f} ms", flush=True)
            path.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
