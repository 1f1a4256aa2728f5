"""A plan as the user reads it: the chosen layout, its runner-ups, and sizes and times in units
people read.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from pipemare.planner.cost import Layout, _bounds


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice and the layouts it beat.

    Attributes:
        best: the fastest layout that fits.
        runner_ups: the next fastest layouts (one per P, D, N), fastest first.
        devices: the devices planned for.
        memory_limit_bytes: per device, or None.
        bandwidth_bytes_per_s: of the links, or None (free).
        considered: how many layouts fitted and were modelled.
        skipped: why the other candidates were left out.
    """

    best: Layout
    runner_ups: tuple[Layout, ...]
    devices: int
    memory_limit_bytes: int | None
    bandwidth_bytes_per_s: float | None
    considered: int
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        """The choice, its modelled step time and memory per stage, and the runner-ups."""
        b = self.best
        limit = _size(self.memory_limit_bytes) if self.memory_limit_bytes else "none"
        link = (
            f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s" if self.bandwidth_bytes_per_s else "free"
        )
        lines = [
            f"pipemare plan: {self.devices} device{'s' if self.devices > 1 else ''}, batch "
            f"{b.batch_size}, schedule {b.schedule}, memory limit {limit} per device, link {link}",
            f"choice: P={b.stages} stages x D={b.replicas} replicas, N={b.microbatches} "
            f"microbatches of {b.microbatch_size}, balance {list(b.balance)}",
            f"modelled step time: {_ms(b.step_s)} ({b.samples_per_s:,.0f} samples/s)",
            "",
            f"{'stage':>5}  {'layers':>9}  {'busy/step':>10}  {'memory':>10}",
        ]
        for j, (lo, hi) in enumerate(_bounds(b.balance)):
            layers = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
            lines.append(
                f"{j:>5}  {layers:>9}  {_ms(b.stage_s[j]):>10}  {_size(b.memory_bytes[j]):>10}"
            )
        lines += ["", f"runner-ups ({self.considered} layouts fitted):"]
        if not self.runner_ups:
            lines.append("  none")
        else:
            lines.append(
                f"{'P':>4} {'D':>3} {'N':>4} {'micro':>6} {'step':>10} {'vs best':>8} "
                f"{'peak memory':>12}  balance"
            )
        for r in self.runner_ups:
            lines.append(
                f"{r.stages:>4} {r.replicas:>3} {r.microbatches:>4} {r.microbatch_size:>6} "
                f"{_ms(r.step_s):>10} {r.step_s / b.step_s:>7.2f}x "
                f"{_size(max(r.memory_bytes)):>12}  {list(r.balance)}"
            )
        if self.skipped:
            lines += ["", f"left out ({len(self.skipped)}):", *(f"  {s}" for s in self.skipped)]
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512 MB"``, ``"1e9"`` -> bytes.

    Example:
        >>> parse_bytes("1.5 GiB"), parse_bytes("512MB"), parse_bytes("1e9")
        (1610612736, 512000000, 1000000000)
    """
    found = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not found or found.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write e.g. 8GiB, 512MB or 1e9 (bytes)"
        )
    try:
        value = float(found.group(1)) * _UNITS[found.group(2)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory limit must be positive, got {text!r}")
    return int(value)
