"""The links of a four-stage pipeline as setup measures them, three times (issue 62).

Four gloo processes, one thread each, measure their three links as a run's setup does
(:func:`pipemare.engine.link_probe.measure_links`, a message of 0.786 MB: the compute-bound
GPT's activation), and rank 0 prints each measurement. On this two-core machine the processes
share cores, so two pairs measuring at once time each other; run alone::

    torchrun --standalone --nproc-per-node=4 experiments/results/links/four_links.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipemare.engine.link_probe import measure_links
from pipemare.engine.transport import DistributedTransport

ACTIVATION = 786_432  # bytes: 8 rows x 64 tokens x width 192, float32


def main() -> None:
    torch.set_num_threads(1)
    DistributedTransport(4, heartbeat_timeout=None)  # the process group, as a run makes it
    for k in range(3):
        dist.barrier()
        links = measure_links([0, 1, 2, 3], [ACTIVATION] * 3)
        if dist.get_rank() == 0:
            print(
                f"measurement {k + 1}: "
                + "; ".join(f"{i}-{i + 1}: {link}" for i, link in enumerate(links))
            )


if __name__ == "__main__":
    main()
