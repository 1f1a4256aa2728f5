"""A stage's random numbers: its own seeded stream, and the replay of what a forward drew.

A stage with its own stream draws the same numbers (dropout masks) whether the stages share a
process or not; a recomputed forward replays the state its first run started from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from pipemare.engine.payload import tensors_in

__all__ = ["RandomStream", "RngState", "replayed"]


class RngState(NamedTuple):
    """The random generators' states when a forward started, for its rerun (dropout masks)."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]  # (device index, state) per CUDA device used


class RandomStream:
    """One stage's own CPU random stream, or the process's global one.

    Args:
        seed: seed of the stage's own stream; None draws from the global generator.
    """

    def __init__(self, seed: int | None) -> None:
        self._state: torch.Tensor | None = None
        if seed is not None:
            self._state = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream inside the block; the global generator is left as it was."""
        if self._state is None:
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self._state)
        try:
            yield
        finally:
            self._state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def now(self, params: Iterable[torch.Tensor], inputs: Any) -> RngState:
        """The random state the next forward over ``params`` and ``inputs`` starts from."""
        cpu = self._state if self._state is not None else torch.get_rng_state()
        cuda: tuple[tuple[int, torch.Tensor], ...] = ()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            used = [*params, *tensors_in(inputs)]
            devices = sorted({int(t.device.index or 0) for t in used if t.is_cuda})
            cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        return RngState(cpu, cuda)

    def state(self) -> torch.Tensor | None:
        """A copy of the stream's state, to save with a checkpoint (None: no stream of its own)."""
        return None if self._state is None else self._state.clone()

    def set_state(self, state: torch.Tensor | None) -> None:
        self._state = None if state is None else state.clone()


@contextlib.contextmanager
def replayed(state: RngState) -> Iterator[None]:
    """Run with the generators as a forward found them; restore them afterwards."""
    with torch.random.fork_rng(devices=[d for d, _ in state.cuda]):
        torch.set_rng_state(state.cpu)
        for device, cuda in state.cuda:
            torch.cuda.set_rng_state(cuda, device)
        yield
