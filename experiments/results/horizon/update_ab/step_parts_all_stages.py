"""Per step, all stages' forwards, backwards and updates of the default on ``gpt_c64s`` at P = 4
and 8, in one process (the median of ``argv[1]`` windows of 24 steps after 8 warm ones), on
whichever pipemare the interpreter imports (``README.md`` here)."""

import copy
import json
import statistics
import sys

import torch

import pipemare
from pipemare.experiments.studies.protocol import TASKS, _pipeline, _timed_model, timed_window

torch.set_num_threads(1)
print("code:", pipemare.__file__, file=sys.stderr)
task = TASKS["gpt_c64s"]
x, y, _, _ = task.data()
out = {}
for p in (4, 8):
    pipe = _pipeline(task, copy.deepcopy(_timed_model(task.name)), "pipemare", p, p, 1e-4, None, 0)
    timed_window(pipe, task, x, y, 8, 0)
    totals: dict[str, list[float]] = {"F": [], "B": [], "U": []}
    for _ in range(int(sys.argv[1])):
        per = {"F": 0.0, "B": 0.0, "U": 0.0}
        for _stage, name, _, start, end in timed_window(pipe, task, x, y, 0, 24):
            if name in per:
                per[name] += end - start
        for k, v in per.items():
            totals[k].append(1e3 * v / 24)
    out[p] = {k: statistics.median(v) for k, v in totals.items()}
print(json.dumps(out))
