"""Bytes a stage keeps alive for the backward passes of its in-flight microbatches.

Storages are told apart by (device, address): each counts once per microbatch, and a storage
several microbatches keep (the minibatch that stage 0's microbatches slice) counts once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

__all__ = ["Held", "SavedBytes", "Storages"]

Storages = dict[tuple[torch.device, int], int]  # (device, address) -> bytes


class Held:
    """Storages one microbatch keeps alive until its backward pass, by (device, address)."""

    __slots__ = ("storages",)

    def __init__(self) -> None:
        self.storages: Storages = {}

    def add(self, t: torch.Tensor) -> None:
        if t.layout is not torch.strided:  # sparse and nested tensors: no single storage
            return
        storage = t.untyped_storage()
        self.storages[t.device, storage.data_ptr()] = storage.nbytes()


class SavedBytes:
    """The bytes held by one stage's in-flight microbatches, now and at the peak.

    Attributes:
        now: bytes held right now.
        peak: the largest ``now`` so far.
    """

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._live: Counter[tuple[torch.device, int]] = Counter()  # in-flight keepers per storage

    def hold(self, held: Held, kept: Iterable[torch.Tensor]) -> Storages:
        """Count a microbatch's ``held`` storages and those of ``kept``; returns them all, for
        :meth:`release`."""
        for t in kept:
            held.add(t)
        for key, nbytes in held.storages.items():
            if self._live[key] == 0:
                self.now += nbytes
            self._live[key] += 1
        self.peak = max(self.peak, self.now)
        return held.storages

    def release(self, storages: Storages | None) -> None:
        """The microbatch that held ``storages`` finished its backward pass."""
        for key, nbytes in (storages or {}).items():
            self._live[key] -= 1
            if self._live[key] == 0:
                del self._live[key]
                self.now -= nbytes
