"""``pipemare bench``: throughput and memory of pipemare's pipelines against the alternatives.

One invocation launches, for each process count P, one ``torchrun`` job (gloo, one thread per
process) that trains the same model, batch and optimiser (SGD, momentum 0.9) in turn as:

- ``single``: the whole model in one process (rank 0; the others wait in a barrier);
- ``torch``: ``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and
  InterleavedZeroBubble with hand-split stages (:mod:`~pipemare.experiments.bench.torch_peer`);
- ``engine``: pipemare's :class:`~pipemare.Pipeline` with every schedule;
- ``lightning``: ``Trainer(strategy=PipeMareStrategy(...))`` with every schedule;

so every ratio compares runs of one launch. Each configuration is one JSON line: samples/s,
per-stage utilisation (compute over wall) and communication seconds, the bubble (mean idle
fraction), memory per stage (weights, optimiser state, stashed weights, correction buffers,
activations) and ratios against single-process training and torch's 1F1B. Then a table and a
bar chart. A separate in-process pass measures stage 0's weight memory under ``pipedream``'s
stash and ``pipemare``'s correction buffers at several P against their analytic values.

Run it alone on the machine: anything else running turns the figures into noise.
"""

from pipemare.experiments.bench.command import decompose, main, run, table
from pipemare.experiments.bench.memory import memory_study, mlp, saved_bytes

__all__ = ["decompose", "main", "memory_study", "mlp", "run", "saved_bytes", "table"]
