"""The planner against the engine: modelled step time against measured, and the planner's cut
against ``balance="time"``, on three models (issue 13).

For each model and layout (schedule, P, N) the model is profiled on this machine
(:func:`pipemare.planner.profile`), cut by the planner's dynamic programme and by
:func:`pipemare.model.partition.balance_by_time`, and both cuts run in the simulator (every stage in
this process) with a timeline probe; the recorded actions are replayed as if each stage had a
device of its own (:func:`pipemare.planner.steady_step_time`), which is the measured step time.
The modelled one is :func:`pipemare.planner.evaluate` on the same cut. Communication is free on
both sides (one process). Run it alone on the machine; it takes about two minutes on two cores::

    python -m pipemare.experiments.studies.plan_study --out experiments/results/planner
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipemare import Pipeline, planner
from pipemare.engine.telemetry import Probe
from pipemare.model.partition import balance_by_time

__all__ = ["LAYOUTS", "MODELS", "main", "measure", "measure_layouts"]

Batch = tuple[torch.Tensor, torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: (schedule, P, N) measured on every model
LAYOUTS: tuple[tuple[str, int, int], ...] = (
    ("pipemare", 2, 4),
    ("pipemare", 4, 4),
    ("pipemare", 4, 2),
    ("pipemare", 4, 1),  # one microbatch: the updates weigh most, which balance="time" ignores
    ("gpipe", 4, 4),
)


def _mlp() -> tuple[nn.Sequential, Batch, Loss]:
    width, blocks, batch = 256, 8, 64
    seq = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)],
        nn.Linear(width, 10),
    )
    return (
        seq,
        (torch.randn(batch, width), torch.randint(0, 10, (batch,))),
        nn.functional.cross_entropy,
    )


def _cnn() -> tuple[nn.Sequential, Batch, Loss]:
    from pipemare.experiments.tasks.classifiers import DigitsCNN
    from pipemare.experiments.tasks.data import digits

    x, y, _, _ = digits()
    batch = 64
    return DigitsCNN().net, (x[:batch].view(-1, 1, 8, 8), y[:batch]), nn.functional.cross_entropy


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _char_lm() -> tuple[nn.Sequential, Batch, Loss]:
    from pipemare.experiments.tasks.data import stdlib_corpus
    from pipemare.experiments.tasks.language_models import CharTransformerLM

    context, batch = 32, 16  # as configs/char_lm.yaml
    data = stdlib_corpus()[: batch * context + 1]
    ids = data[:-1].view(batch, context)
    targets = data[1:].view(batch, context)
    net = CharTransformerLM(d_model=64, heads=4, layers=6, context=context).net
    return net, (ids, targets), _lm_loss


#: name -> () -> (Sequential, one minibatch, loss)
MODELS: dict[str, Callable[[], tuple[nn.Sequential, Batch, Loss]]] = {
    "balanced MLP": _mlp,
    "digits CNN": _cnn,
    "char LM": _char_lm,
}


def measure(
    seq: nn.Sequential,
    batch: Batch,
    loss: Loss,
    schedule: str,
    stages: int,
    microbatches: int,
    balance: list[int],
    steps: int = 16,
    windows: int = 3,
) -> list[float]:
    """Measured step time of each window of ``steps`` steps, after the pipeline filled.

    Trains a copy of ``seq`` with Adam in the simulator; every window's timeline is replayed
    with each stage on a device of its own.
    """
    model = copy.deepcopy(seq)
    pipe = Pipeline(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-4),
        loss,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        balance=balance,
        seed=0,
    )
    for _ in range(-(-stages // microbatches) + 3):  # fill, and warm the caches up
        pipe.step(batch)
    times = []
    for _ in range(windows):
        probe = Probe(timeline=True)
        pipe.probe = probe
        for _ in range(steps):
            pipe.step(batch)
        pipe.probe = None
        times.append(planner.steady_step_time(probe.take_spans(), stages))
    return times


def measure_layouts(steps: int = 16, rounds: int = 5, repeats: int = 6) -> list[dict[str, Any]]:
    """Every model and layout: modelled and measured step times, planner's and time's cut.

    Each round profiles the model afresh and then measures every layout, so the modelled and
    the measured time of a round are taken close together (the machine's load drifts); the
    table holds the medians over rounds. The cuts are chosen first, on a profile of their
    own (three rounds, as :func:`pipemare.planner.auto_balance` takes it).
    """
    rows = []
    for name, build in MODELS.items():
        torch.manual_seed(0)
        seq, batch, loss = build()
        x, y = batch
        size = x.shape[0]
        schedules = sorted({s for s, _, _ in LAYOUTS})
        sizes = {s: sorted({size // n for t, _, n in LAYOUTS if t == s}) for s in schedules}
        cuts = _cuts(seq, x, y, loss, sizes, repeats)
        got: dict[tuple[str, int, int], dict[str, list[float]]] = {
            lay: {k: [] for k in ("planner", "time", "m_planner", "m_time")} for lay in LAYOUTS
        }
        for r in range(rounds):
            start = time.perf_counter()
            profiles = {
                s: planner.profile(
                    seq,
                    x,
                    target=y,
                    loss_fn=loss,
                    schedule=s,
                    microbatch_sizes=sizes[s],
                    repeats=repeats,
                    rounds=1,
                )
                for s in schedules
            }
            for layout in LAYOUTS:
                schedule, p, n = layout
                prof, m = profiles[schedule], size // n
                for who, cut in cuts[layout].items():
                    model = planner.evaluate(prof, cut, microbatches=n, microbatch_size=m)
                    got[layout]["m_" + who].append(model.step_s)
                    if who == "time" and cut == cuts[layout]["planner"]:
                        got[layout]["time"].append(got[layout]["planner"][-1])
                    else:
                        got[layout][who] += measure(
                            seq, batch, loss, schedule, p, n, cut, steps, windows=1
                        )
            print(f"{name}: round {r + 1} of {rounds} in {time.perf_counter() - start:.1f} s")
        for layout in LAYOUTS:
            rows.append(_row(name, layout, size, cuts[layout], got[layout]))
            _show(rows[-1])
    return rows


def _cuts(
    seq: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Loss,
    sizes: dict[str, list[int]],
    repeats: int,
) -> dict[tuple[str, int, int], dict[str, list[int]]]:
    """Each layout's cut by the planner and by ``balance_by_time``."""
    profiles = {
        s: planner.profile(
            seq, x, target=y, loss_fn=loss, schedule=s, microbatch_sizes=m, repeats=repeats
        )
        for s, m in sizes.items()
    }
    cuts = {}
    for schedule, p, n in LAYOUTS:
        m = x.shape[0] // n
        best = planner.plan(
            profiles[schedule], devices=p, batch_size=x.shape[0], microbatches=[n], stages=[p]
        ).best
        cuts[schedule, p, n] = {
            "planner": list(best.balance),
            "time": balance_by_time(seq, x[:m], p),
        }
    return cuts


def _row(
    name: str,
    layout: tuple[str, int, int],
    size: int,
    cuts: dict[str, list[int]],
    got: dict[str, list[float]],
) -> dict[str, Any]:
    schedule, p, n = layout
    med = {k: statistics.median(v) for k, v in got.items()}

    def spread(who: str) -> list[float]:
        ratios = [a / b for a, b in zip(got["m_" + who], got[who], strict=True)]
        return [min(ratios), max(ratios)]

    return {
        "model": name,
        "schedule": schedule,
        "P": p,
        "N": n,
        "microbatch": size // n,
        "planner_balance": cuts["planner"],
        "modelled_s": med["m_planner"],
        "measured_s": med["planner"],
        "ratio": med["m_planner"] / med["planner"],
        "ratio_per_round": spread("planner"),
        "time_balance": cuts["time"],
        "time_modelled_s": med["m_time"],
        "time_measured_s": med["time"],
        "time_ratio": med["m_time"] / med["time"],
        "planner_vs_time": med["planner"] / med["time"],
        "rounds": got,
    }


def _show(row: dict[str, Any]) -> None:
    print(
        f"  {row['schedule']} P={row['P']} N={row['N']}: planner {row['planner_balance']} "
        f"modelled {row['modelled_s'] * 1e3:.2f} ms measured {row['measured_s'] * 1e3:.2f} ms "
        f"(x{row['ratio']:.2f}); time {row['time_balance']} measured "
        f"{row['time_measured_s'] * 1e3:.2f} ms"
    )


def _table(rows: list[dict[str, Any]], command: str, load: tuple[float, float]) -> str:
    lines = [
        "# Planner: modelled against measured step time",
        "",
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, load average "
        f"{load[0]:.2f} before and {load[1]:.2f} after (2 cores, shared). Measured: the "
        "simulator's timeline replayed with one device per stage; modelled: the planner's cost "
        "model on a profile taken just before, in the same round; medians over the rounds "
        "(the per-round ratios' range in brackets). Communication is free on both sides.",
        "",
        "| model | schedule | P | N | planner cut | modelled ms | measured ms | "
        "modelled/measured | balance=time cut | its measured ms | its modelled/measured | "
        "planner/time measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['P']} | {r['N']} | {r['planner_balance']} "
            f"| {r['modelled_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | {r['ratio']:.2f} "
            f"[{r['ratio_per_round'][0]:.2f}–{r['ratio_per_round'][1]:.2f}] "
            f"| {r['time_balance']} | {r['time_measured_s'] * 1e3:.2f} | {r['time_ratio']:.2f} "
            f"| {r['planner_vs_time']:.2f} |"
        )
    ratios = [r[k] for r in rows for k in ("ratio", "time_ratio")]
    within = sum(abs(x - 1) <= 0.2 for x in ratios)
    lines += [
        "",
        f"Modelled/measured within 20%: {within} of {len(ratios)} (both cuts of every layout); "
        f"range {min(ratios):.2f}–{max(ratios):.2f}.",
        "Planner's cut at most 5% slower than balance=time's (measured): "
        f"{sum(r['planner_vs_time'] <= 1.05 for r in rows)} of {len(rows)}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/planner")
    parser.add_argument("--steps", type=int, default=16, help="steps per measured window")
    parser.add_argument("--rounds", type=int, default=5, help="profiles and measurements")
    parser.add_argument("--repeats", type=int, default=6, help="timed steps of each profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m pipemare.experiments.studies.plan_study " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    before = os.getloadavg()[0]
    start = time.perf_counter()
    rows = measure_layouts(args.steps, args.rounds, args.repeats)
    after = os.getloadavg()[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = _table(rows, command.strip(), (before, after))
    (out / "planner.md").write_text(table)
    meta = {"command": command.strip(), "load_before": before, "load_after": after}
    (out / "planner.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(table)
    print(f"wrote {out}/planner.md and planner.json in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
