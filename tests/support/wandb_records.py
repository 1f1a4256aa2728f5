"""Read an offline W&B run (``run-*.wandb``): a LevelDB-style log of protobuf records.

wandb 0.31 writes an offline run's history, summary and config only into this file, so the
tests read it to check what W&B would upload.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, chunk = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if pos + _HEADER + length > len(data):
            break  # a record still being written (wandb's service may append after finish)
        body = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            pos += left - _HEADER
            continue
        chunk = body if kind in (_FULL, _FIRST) else chunk + body
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def run_contents(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """``(config, summary, history rows)`` of an offline run directory."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    (path,) = run_dir.glob("run-*.wandb")
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "config":
            for item in r.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
    return config, summary, history
