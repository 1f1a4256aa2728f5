"""The update's parts on stage 1 of ``gpt_c64s`` at P = 4 and 8 (``step_parts.update_cost``), on
whichever pipemare the interpreter imports: run it from outside the repository, once with
``PYTHONPATH`` pointing at an older tree laid out as ``experiments/results/bench/ab_release/ab.sh``
describes, once without, in turn (``README.md`` here)."""

import importlib.util

import torch

import pipemare

torch.set_num_threads(1)
print("code:", pipemare.__file__)
root = pipemare.__file__.rsplit("/pipemare/", 1)[0]
spec = importlib.util.spec_from_file_location(
    "step_parts", root + "/experiments/results/horizon/step_parts.py"
)
assert spec is not None and spec.loader is not None
step_parts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_parts)
for p in (4, 8):
    step_parts.update_cost("gpt_c64s", p, 8, 200)
