"""Pipelined validation, test and predict steps, numbered across every loop alike.

Evaluation runs after the pipeline drained; its batches overlap in the pipeline as training's
do. Each step reports what every process already has: the output of the batch ``P - 1``
batches earlier with a process per stage (stage 0 runs that far ahead of the last), the
batch's own in one process and for ``predict_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipemare.engine.lagged import Results
from pipemare.engine.microbatch import batch_size, combine, scatter
from pipemare.engine.pipeline import Pipeline
from pipemare.lightning.steps import UserSteps, closes_loader

__all__ = ["Evaluation"]


class Evaluation:
    """Pipelined validation, test and predict steps, numbered across every loop alike."""

    def __init__(self) -> None:
        self.results: Results | None = None
        self.index = 0  # evaluation batches run so far

    def step(
        self,
        pipe: Pipeline,
        steps: UserSteps,
        name: str,
        batch: Any,
        batch_idx: int,
        args: tuple,
        *,
        results: Callable[[int], Results],
        microbatches: int,
        ahead: int,
        trainer: Any,
        device: torch.device,
    ) -> Any:
        """Run ``batch`` through the pipeline and return the latest step output reported.

        Args:
            results: makes the results that evaluation publishes into, from a minibatch index.
            ahead: batches by which stage 0 runs ahead of the last stage (P - 1 with a process
                per stage, else 0).
        """
        steps.begin(name, batch, (batch_idx, *args))
        if self.results is None:
            self.results = results(0)
        steps.results = self.results
        j, self.index = self.index, self.index + 1
        n = min(microbatches, batch_size(batch))
        outputs = pipe.evaluate(batch, input_fn=steps.input, head=steps.head, microbatches=n)
        if outputs is not None:  # the last stage
            sizes = [batch_size(c) for c in scatter(batch, n)]
            steps.publish(j, combine(outputs, sizes))
        # With a process per stage, stage 0 runs up to P - 1 batches ahead of the last stage;
        # predictions are collected per batch, so predict reports each batch's own.
        lag = ahead if name != "predict_step" else 0
        upto = j if closes_loader(trainer, batch_idx, args) else j - lag
        values = steps.replay_through(upto, device)
        return values[-1] if values else None
