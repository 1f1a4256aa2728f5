"""Worker for test_link: two processes over gloo, launched by torchrun.

``--what delay``: rank 0 sends messages of known size over a simulated link and rank 1 notes
when each became receivable; ``--what train``: the shared test model trained over a simulated
link (its weights must not depend on the link); ``--what measure``: the links measured at
setup (latency, bandwidth, and each message's CPU on either side), as each rank sees them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipemare.engine.link_probe import measure_links
from pipemare.engine.transport import ACT, DistributedTransport
from support import dist_worker

SIZE = 25_000  # float32 entries: 100 kB


def delay(out: Path, link: str) -> None:
    transport = DistributedTransport(2, simulated_link=link, heartbeat_timeout=None)
    rank = dist.get_rank()
    dist.barrier()
    if rank == 0:
        sent = []
        for k in range(3):
            sent.append(time.time())
            transport.send(0, 1, ACT, k, torch.full((SIZE,), float(k)))
        transport.flush()
        record = {"sent": sent}
    else:
        got, values = [], []
        for k in range(3):
            payload = transport.recv(0, 1, ACT, k)
            got.append(time.time())
            values.append(float(payload[0]))
            transport.release(0, 1, ACT, k)
        record = {"got": got, "values": values}
    (out / f"delay-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


def train(out: Path, link: str) -> None:
    for schedule in ("async", "1f1b"):
        transport = DistributedTransport(2, simulated_link=link, heartbeat_timeout=None)
        _, pipe, _ = dist_worker.train(schedule, 2, transport)
        stage = pipe.transport.local_stages[0]
        state = pipe.stage_modules[stage].state_dict()
        torch.save({"stage": stage, "state": state}, out / f"{schedule}-rank{stage}.pt")
        dist.barrier()


def measure(out: Path) -> None:
    if not dist.is_initialized():
        DistributedTransport(2, heartbeat_timeout=None)  # the process group
    links = measure_links([0, 1], [SIZE * 4])
    record = [[link.latency_s, link.bandwidth, link.send_s, link.recv_s] for link in links]
    (out / f"measure-rank{dist.get_rank()}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--what", nargs="+", choices=["delay", "train", "measure"], required=True)
    parser.add_argument("--link", default="8Mb/s@50ms")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for what in args.what:  # in one launch, one after another
        if what == "delay":
            delay(args.out, args.link)
        elif what == "train":
            train(args.out, args.link)
        else:
            measure(args.out)


if __name__ == "__main__":
    main()
