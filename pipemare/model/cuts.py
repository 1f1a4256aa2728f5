"""Which module of a LightningModule is pipelined, and whether it can be cut as asked.

Both checks run at setup, before anything trains; every error says what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipemare.model import partition

__all__ = ["check_cut", "find_sequential"]


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The Sequential to pipeline: ``name`` (a dotted attribute path), or the only one there is.

    Raises:
        ValueError: no Sequential, several candidates, or ``name`` is not a Sequential.
    """
    if name is not None:
        try:
            found = module.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"{type(module).__name__} has no submodule {name!r} to pipeline; pass the "
                f"attribute that holds your nn.Sequential, e.g. sequential='net'"
            ) from None
        if not isinstance(found, nn.Sequential):
            raise ValueError(
                f"{type(module).__name__}.{name} is a {type(found).__name__}, not an "
                "nn.Sequential; "
                "pipemare cuts an nn.Sequential into stages: wrap the layers in one"
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if not candidates:
        nested = _outermost_sequentials(module)
        if nested:
            raise ValueError(
                f"{type(module).__name__} has no nn.Sequential attribute to pipeline, but holds "
                f"{', '.join(nested)} deeper down; name the one to pipeline with "
                f"PipeMareStrategy(sequential='{nested[0]}')"
            )
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential attribute to pipeline; hold the layers "
            "in one (self.net = nn.Sequential(...)) and call it in training_step, or name a "
            "nested one with PipeMareStrategy(sequential='model.layers')"
        )
    if len(candidates) > 1:
        names = ", ".join(n for n, _ in candidates)
        raise ValueError(
            f"{type(module).__name__} has several nn.Sequential attributes ({names}); choose the "
            f"one to pipeline with PipeMareStrategy(sequential='{candidates[0][0]}')"
        )
    return candidates[0]


def _outermost_sequentials(module: nn.Module) -> list[str]:
    """Dotted paths of the Sequentials in ``module`` that no other Sequential holds."""
    found: list[str] = []
    for name, m in module.named_modules():
        inside = any(name.startswith(f + ".") for f in found)
        if name and isinstance(m, nn.Sequential) and not inside:
            found.append(name)
    return found


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
    if balance in ("time", "auto", "params") and p < len(seq):
        return p
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
