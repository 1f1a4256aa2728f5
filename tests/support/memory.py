"""How many tensors a process holds, for the tests that look for leaks."""

from __future__ import annotations

import gc

import torch


def settle_imports() -> None:
    """Set aside what the process holds so far (its imports: some 450,000 objects) from the
    collector, so that each :func:`live_tensors` after it costs milliseconds, not half a second
    of CPU; what is created afterwards (every tensor a run makes) is counted as before."""
    gc.collect()
    gc.freeze()


def live_tensors() -> int:
    """The tensors the garbage collector can reach, after a full collection (since
    :func:`settle_imports`, those created after it)."""
    gc.collect()
    # by the type, never isinstance: that warns on some deprecated module-level torch objects
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))
