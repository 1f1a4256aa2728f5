"""Errors pipemare raises while training, with what a user needs to act on them."""

from __future__ import annotations

__all__ = ["NonFiniteGradientError", "NonFiniteLossError", "out_of_order"]


class NonFiniteLossError(RuntimeError):
    """A minibatch's loss came out NaN or infinite: training stops instead of going on.

    Attributes:
        step: the training step (counted from 1) whose minibatch gave the loss.
        stage: the stage that computed it (the last one).
    """

    def __init__(self, step: int, stage: int, loss: float, where: str = "") -> None:
        self.step, self.stage, self.loss, self.where = step, stage, loss, where
        super().__init__(
            f"pipemare: the loss of step {step} is {loss} (computed on stage {stage}, the last"
            f"{where}); training stopped so that nothing trains on NaN/Inf weights and the last "
            "good checkpoint stays as it is. Attach pipemare.callbacks.ConvergenceMonitor to "
            "find the first stage whose output was not finite; lower the learning rate, clip "
            "gradients (gradient_clip_val) or check the data for NaN."
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, float, str]]:
        # rebuilt from its fields, not from the message (a process pool sends it back)
        return type(self), (self.step, self.stage, self.loss, self.where)


class NonFiniteGradientError(RuntimeError):
    """A stage's accumulated gradients held NaN or Inf at its update; the update was skipped.

    Attributes:
        step: the training step (counted from 1) whose minibatch gave the gradients.
        stage: the stage whose update it was.
        names: the parameters (within the stage's layers) with non-finite gradients.
    """

    def __init__(self, step: int, stage: int, names: list[str], where: str = "") -> None:
        self.step, self.stage, self.names, self.where = step, stage, names, where
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            f"pipemare: the gradients of step {step} on stage {stage}{where} are not finite "
            f"({shown}) while the loss was; the update was not applied and training stopped, so "
            "the weights and the last checkpoint stay finite. Look for an operation whose "
            "backward overflows (e.g. a sqrt or log at 0, a division by a small number), lower "
            "the learning rate or clip gradients (gradient_clip_val)."
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, list[str], str]]:
        return type(self), (self.step, self.stage, self.names, self.where)


def out_of_order(src: int, dst: int, channel: str, want: int, got: int) -> RuntimeError:
    """The error of a stage that received another microbatch's message than it expected."""
    return RuntimeError(
        f"stage {dst} expected {channel} of microbatch {want} from stage {src} but got "
        f"microbatch {got}: the stages run different schedules or step counts"
    )
