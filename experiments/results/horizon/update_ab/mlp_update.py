"""Per step, both stages' forwards, backwards and updates of the default on the bench's MLP (width
1024, 8 layers, SGD with momentum 0.9, P = 2, N = 4, batch 256) in one process: the median of 6
windows of 10 steps after 5 warm ones, on whichever pipemare the interpreter imports
(``README.md`` here)."""

import json
import statistics

import torch

import pipemare
from pipemare import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.experiments.bench.memory import mlp

torch.set_num_threads(1)
torch.manual_seed(0)
model = mlp(1024, 8)
sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
pipe = Pipeline(model, sgd, torch.nn.functional.cross_entropy, stages=2, microbatches=4)
x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
for _ in range(5):
    pipe.step((x, y))
totals: dict[str, list[float]] = {"F": [], "B": [], "U": []}
for _ in range(6):
    probe = Probe(timeline=True)
    pipe.probe = probe
    for _ in range(10):
        pipe.step((x, y))
    pipe.probe = None
    per = {"F": 0.0, "B": 0.0, "U": 0.0}
    for _stage, name, _, start, end in probe.take_spans():
        if name in per:
            per[name] += end - start
    for k, v in per.items():
        totals[k].append(1e3 * v / 10)
out = {k: round(statistics.median(v), 2) for k, v in totals.items()}
out["U_share"] = round(out["U"] / (out["F"] + out["B"] + out["U"]), 4)
print(pipemare.__file__.split("/")[2], json.dumps(out))
