"""Errors pipemare raises while training, with what a user needs to act on them."""

from __future__ import annotations

from pipemare.lines import text

__all__ = ["NonFiniteGradientError", "NonFiniteLossError", "out_of_order"]


class NonFiniteLossError(RuntimeError):
    """A minibatch's loss came out NaN or infinite: training stops instead of going on.

    Attributes:
        step: the training step (counted from 1) whose minibatch gave the loss.
        stage: the stage that computed it (the last one).
    """

    def __init__(self, step: int, stage: int, loss: float, where: str = "") -> None:
        self.step, self.stage, self.loss, self.where = step, stage, loss, where
        super().__init__(text("loss.nonfinite", step=step, stage=stage, loss=loss, where=where))

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
            text("gradients.nonfinite", step=step, stage=stage, where=where, names=shown)
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, list[str], str]]:
        return type(self), (self.step, self.stage, self.names, self.where)


def out_of_order(src: int, dst: int, channel: str, want: int, got: int) -> RuntimeError:
    """The error of a stage that received another microbatch's message than it expected."""
    return RuntimeError(
        f"stage {dst} expected {channel} of microbatch {want} from stage {src} but got "
        f"microbatch {got}: the stages run different schedules or step counts"
    )
