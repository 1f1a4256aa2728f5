"""What the strategy says to expect is what the user's protocol measured."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch

from pipemare.experiments.studies.protocol import TASKS
from pipemare.optim import resolve
from pipemare.optim.expectations import MEASURED, expectation, optimizer_family

RESULTS = Path(__file__).resolve().parents[2] / "experiments/results/user_protocol/results.json"

#: each task's optimiser family, as :func:`optimizer_family` reads its optimiser
FAMILIES = {"adam": "adam", "adamw": "adam", "muon": "muon", "sgdm": "sgd"}


def test_the_table_is_the_published_protocols_verdicts():
    results = json.loads(RESULTS.read_text())
    counted: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0])
    for name, task in results["tasks"].items():
        if task["held_out"]:
            continue  # decides nothing
        kind = FAMILIES[TASKS[name].optimizer]
        for p, stage in task["stages"].items():
            row = next(r for r in stage["rows"] if r["schedule"] == "pipemare" and r["default_n"])
            counted[(kind, int(p))][0] += row["verdict"]["sooner"]
            counted[(kind, int(p))][1] += 1
    assert {k: tuple(v) for k, v in counted.items()} == MEASURED


def test_a_losing_layout_is_said_once_at_setup_and_a_winning_one_is_not():
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizers = {
        "adam": torch.optim.AdamW(params, lr=1e-3),
        "sgd": torch.optim.SGD(params, lr=0.1, momentum=0.9),
    }
    for (kind, p), (sooner, tasks) in MEASURED.items():
        if kind not in optimizers:
            continue
        opt = optimizers[kind]
        assert optimizer_family(opt) == kind
        said = expectation(opt, p)
        assert (said is not None) == (2 * sooner <= tasks)
        decided = [d for d in resolve(None, opt, stages=p, microbatches=p).decisions]
        expect = [d for d in decided if d.subject == "what to expect"]
        assert [d.choice for d in expect] == ([said] if said else [])
        # at N = 1 (not the default layout) nothing measured applies
        at_one = resolve(None, opt, stages=p, microbatches=1).decisions
        assert not [d for d in at_one if d.subject == "what to expect"]
    assert optimizer_family(torch.optim.SGD(params, lr=0.1)) is None  # plain SGD: not measured
