"""Errors pipemare raises while training, with what a user needs to act on them."""

from __future__ import annotations

__all__ = ["NonFiniteLossError"]


class NonFiniteLossError(RuntimeError):
    """A minibatch's loss came out NaN or infinite: training stops instead of going on.

    Attributes:
        step: the training step (counted from 1) whose minibatch gave the loss.
        stage: the stage that computed it (the last one).
    """

    def __init__(self, step: int, stage: int, loss: float, where: str = "") -> None:
        self.step, self.stage, self.loss = step, stage, loss
        super().__init__(
            f"pipemare: the loss of step {step} is {loss} (computed on stage {stage}, the last"
            f"{where}); training stopped so that nothing trains on NaN/Inf weights and the last "
            "good checkpoint stays as it is. Attach pipemare.callbacks.ConvergenceMonitor to "
            "find the first stage whose output was not finite; lower the learning rate, clip "
            "gradients (gradient_clip_val) or check the data for NaN."
        )
