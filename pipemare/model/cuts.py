"""Which module of a LightningModule is pipelined, the ways to cut it, and whether it can be cut.

The checks run at setup, before anything trains; every error says what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipemare.model import partition

__all__ = ["BALANCES", "FROM_A_SAMPLE", "check_cut", "find_pipelined"]

#: The named ways to cut a Sequential into stages, for the engine and the strategy alike; the
#: other way is a list of layer counts, one per stage. The defaults differ for one reason: the
#: strategy has its first batch to time the layers on ("time"), while a bare
#: :class:`~pipemare.engine.pipeline.Pipeline` is built before it sees any batch ("even").
BALANCES: dict[str, str] = {
    "time": "equal measured forward+backward time per stage, timed on a sample batch",
    "auto": "the planner's cut for this P and N, from a profile of time, memory and the "
    "engine's costs (pipemare.planner)",
    "params": "equal parameter counts per stage",
    "even": "equal layer counts per stage",
}

#: The names whose cut is chosen from a sample batch (the strategy's first batch).
FROM_A_SAMPLE = ("time", "auto")


def find_pipelined(module: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """The module to pipeline: ``name`` (a dotted attribute path), or else the one child that
    holds the trainable parameters (an ``nn.Sequential`` child when no child trains).

    Raises:
        ValueError: ``name`` is not a submodule, or no child or several could be meant.
    """
    owner = type(module).__name__
    if name is not None:
        try:
            return name, module.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"{owner} has no submodule {name!r} to pipeline; pass the attribute that holds "
                f"your model, e.g. module='net' or module='model.transformer'"
            ) from None
    children = list(module.named_children())
    training = [(n, m) for n, m in children if any(p.requires_grad for p in m.parameters())]
    if len(training) == 1:
        return training[0]
    if len(training) > 1:
        names = ", ".join(n for n, _ in training)
        raise ValueError(
            f"{owner} has several submodules with trainable parameters ({names}); pipemare "
            "pipelines the one module the step calls: name it with "
            f"PipeMareStrategy(module='{training[0][0]}'), or hold them all in one module"
        )
    sequentials = [(n, m) for n, m in children if isinstance(m, nn.Sequential)]
    if len(sequentials) == 1:
        return sequentials[0]
    raise ValueError(
        f"{owner} has no submodule with trainable parameters to pipeline; hold the model in an "
        "attribute (self.net = ..., self.model = ...) and call it in training_step, or name "
        "it with PipeMareStrategy(module='model')"
    )


def check_cut(
    what: str,
    seq: nn.Sequential,
    balance: Sequence[int] | str,
    stages: int | None,
    num_stages: int | None,
    distributed: bool,
) -> int:
    """Refuse, before anything runs, a Sequential that cannot be cut as asked; return P.

    Args:
        what: the Sequential's name in errors, e.g. ``"Net.layers"``.
        seq: the Sequential.
        balance: the strategy's ``balance``.
        stages: the strategy's ``stages`` argument.
        num_stages: the run's stage count, where known (with a process per stage, always).
        distributed: whether each stage runs in a process of its own.
    """
    partition.check_sequential(seq, what)
    p = num_stages or len(seq)
    if p > len(seq):
        raise ValueError(
            f"cannot cut {what} ({len(seq)} layers) into {p} stages: every stage needs "
            f"at least one layer; use at most {len(seq)} stages or split the model into more "
            "layers"
        )
    if isinstance(balance, str) and balance != "even" and p < len(seq):
        return p  # chosen later, one layer per stage at least
    if isinstance(balance, str):
        counts = partition.even_balance(len(seq), p)
    else:
        counts = list(balance)
        if len(counts) != p:
            run = (
                f"stages={num_stages}"
                if distributed and stages is not None
                else "one per process"
                if distributed
                else f"stages={stages}"
                if stages is not None
                else f"one per layer of {what}, the default with devices=1"
            )
            also = "" if distributed else f", or pass stages={len(counts)}"
            raise ValueError(
                f"balance {counts} lists {len(counts)} stages but the run has {p} "
                f"({run}); give one layer count per stage{also}"
            )
        partition.check_balance(counts, len(seq), what)
    return p
