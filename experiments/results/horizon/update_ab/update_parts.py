"""The update's parts on stage 1 of ``gpt_c64s`` at P = 4 and 8 (``step_parts.update_cost``), on
whichever pipemare the interpreter imports: run it from outside the repository, once with
``PYTHONPATH`` pointing at an older tree laid out as ``experiments/results/bench/ab_release/ab.sh``
describes, once without, in turn (``README.md`` here)."""

import torch
from load_step_parts import step_parts

import pipemare

torch.set_num_threads(1)
print("code:", pipemare.__file__)
for p in (4, 8):
    step_parts.update_cost("gpt_c64s", p, 8, 200)
