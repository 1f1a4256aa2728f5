"""Worker for test_failures: two processes over gloo, launched with the environment torchrun
gives. Rank 1 leaves right after the transport is set up; rank 0 waits until the connection
to it is known reset (a bare send on the activation channel's header group raises), then sends
an activation through the transport and writes what that raised to ``--out``/posting.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipemare.engine.transport import ACT, DistributedTransport


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    transport = DistributedTransport(2, heartbeat_timeout=None)
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a word, as a killed process is
    deadline = time.monotonic() + 60
    while not _gone(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    header_group = transport._outbox[1, ACT].groups[0]
    reset = False
    while not reset and time.monotonic() < deadline:
        try:
            dist.isend(torch.zeros(1, dtype=torch.int64), dst=1, group=header_group)
            time.sleep(0.05)
        except RuntimeError:
            reset = True
    record: dict[str, object] = {"reset_seen": reset, "pid": pids[1]}
    try:
        transport.send(0, 1, ACT, 0, torch.ones(4))
        record["raised"] = None
    except Exception as err:  # what a user's run would be stopped with
        record.update(raised=type(err).__name__, message=str(err))
    (out / "posting.json").write_text(json.dumps(record))
    os._exit(0)  # the peer is gone: no collective teardown


if __name__ == "__main__":
    main()
