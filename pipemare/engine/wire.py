"""A message's header between ranks: its microbatch, each tensor's dtype and shape, and the
sender's progress.

Header: [microbatch, count (-1: one bare tensor), then per tensor: dtype code (-1 = None),
ndim, dims..., zeros, then the time (microseconds since the epoch) before which a simulated
link holds the message (0: no simulated link, :mod:`pipemare.engine.link`), and last the steps
the sender's stage had completed (for the error that names a failed stage's progress)]. The
entries between the first and the last two are the message's *signature*
(:func:`signature`): two messages with equal signatures fit the same receive buffers.
"""

from __future__ import annotations

from typing import Any

import torch

from pipemare.engine.payload import tensors

__all__ = ["HEADER", "buffers", "decode", "deliver_at", "encode", "signature"]

HEADER = 128  # entries, int64
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def encode(microbatch: int, payload: Any, completed: int = 0, deliver_at: float = 0.0) -> list[int]:
    """The header of ``payload``, ``microbatch``'s, from a stage that completed ``completed``
    steps; a simulated link holds it until ``deliver_at`` (seconds since the epoch; 0: never)."""
    bare = isinstance(payload, torch.Tensor)
    items = tensors(payload)
    header = [microbatch, -1 if bare else len(items)]
    for t in items:
        if t is None:
            header += [-1, 0]
            continue
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send tensors of dtype {t.dtype} between stages")
        header += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(header) > HEADER - 2:
        raise ValueError(
            f"a stage output of {len(items)} tensors with these shapes needs a "
            f"{len(header)}-entry header, more than {HEADER - 2}; return fewer or flatter tensors"
        )
    return header + [0] * (HEADER - 2 - len(header)) + [round(deliver_at * 1e6), completed]


def signature(header: list[int]) -> tuple[int, ...]:
    """The entries of ``header`` that say which receive buffers its message fits."""
    return tuple(header[1:-2])


def deliver_at(header: list[int]) -> float:
    """Seconds since the epoch before which a simulated link holds the message (0: none)."""
    return header[-2] / 1e6


def decode(
    header: list[int],
) -> tuple[int, bool, list[tuple[torch.dtype, tuple[int, ...]] | None]]:
    """``(microbatch, bare, [(dtype, shape) or None per tensor])`` of a header."""
    microbatch, count, pos = header[0], header[1], 2
    specs: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for _ in range(1 if count < 0 else count):
        code, ndim = header[pos], header[pos + 1]
        pos += 2
        if code < 0:
            specs.append(None)
            continue
        specs.append((_DTYPES[code], tuple(header[pos : pos + ndim])))
        pos += ndim
    return microbatch, count < 0, specs


def buffers(signature: tuple[int, ...], device: torch.device) -> list[torch.Tensor | None]:
    """Empty tensors that receive a message of ``signature`` (None where it sends None)."""
    _, _, specs = decode([0, *signature])
    return [None if s is None else torch.empty(s[1], dtype=s[0], device=device) for s in specs]
