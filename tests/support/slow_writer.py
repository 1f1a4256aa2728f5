"""Saves a checkpoint that never finishes: prints "writing" once half of it is written, then
blocks until the test kills this process (by PID)."""

from __future__ import annotations

import sys
import time

import torch

from pipemare.lightning.checkpoint_io import atomic_save


class Stall:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(600)
        return (int, (0,))


if __name__ == "__main__":
    atomic_save({"big": torch.ones(1_000_000), "then": Stall()}, sys.argv[1])
