"""``step_parts`` (``../step_parts.py``) of whichever pipemare tree the interpreter imports, for
this folder's scripts: they compare an older tree with today's, so the module must come from
the tree under test, not from this checkout."""

import importlib.util

import pipemare

ROOT = pipemare.__file__.rsplit("/pipemare/", 1)[0]
_spec = importlib.util.spec_from_file_location(
    "step_parts", ROOT + "/experiments/results/horizon/step_parts.py"
)
assert _spec is not None and _spec.loader is not None
step_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_parts)
