"""Where to cut a model by default: before each of its repeated blocks and after the last one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["Cut", "as_cuts", "block_cuts", "halved", "pp_plan_cuts"]


@dataclass(frozen=True)
class Cut:
    """A cut at a module's boundary: before its first operation (torch's
    ``SplitPoint.BEGINNING``) or, with ``after=True``, after its last one (``SplitPoint.END``).

    Example:
        ``Cut("transformer.h.2")`` starts a segment with block 2.
    """

    module: str
    after: bool = False

    def __str__(self) -> str:
        return f"after {self.module!r}" if self.after else f"before {self.module!r}"


def as_cuts(split_points: Sequence[str | Cut]) -> list[Cut]:
    """Cuts from the user's ``split_points``: a module name means a cut before that module."""
    cuts = []
    for point in split_points:
        if isinstance(point, str):
            cuts.append(Cut(point))
        elif isinstance(point, Cut):
            cuts.append(point)
        else:
            raise TypeError(
                f"split point {point!r} must be a module name such as 'transformer.h.2' (a cut "
                "before that module) or a Cut"
            )
    return cuts


def _blocks_cut(names: list[str]) -> list[Cut]:
    # Before every block, and after the last: the head (final norm, classifier) is a segment of
    # its own, as the stem before the first block is.
    return [Cut(name) for name in names] + ([Cut(names[-1], after=True)] if names else [])


def block_cuts(module: nn.Module) -> list[Cut]:
    """The default cuts: around each instance of the model's repeated block.

    The repeated block is the class of module that holds the most parameters in total among the
    entries of the model's ``nn.ModuleList``s and ``nn.Sequential``s (GPT's ``Block``s in
    ``transformer.h``, a ResNet's ``BasicBlock``s across ``layer1``..``layer4``, the layers of a
    plain ``nn.Sequential``); ties go to the coarser class (fewer instances). Instances nested
    inside another instance are not cut.

    Returns:
        A cut before each block and one after the last block; ``[]`` where the model has no
        ModuleList or Sequential with entries.
    """
    instances: dict[type, list[str]] = defaultdict(list)
    for name, container in module.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child_name, child in container._modules.items():
                if child is not None:
                    instances[type(child)].append(f"{name}.{child_name}" if name else child_name)
    if not instances:
        return []

    def weight(kind: type) -> tuple[int, int]:
        params = {
            id(p): p.numel() for n in instances[kind] for p in module.get_submodule(n).parameters()
        }
        return sum(params.values()), -len(instances[kind])

    chosen = max(instances, key=weight)
    order = {name: i for i, (name, _) in enumerate(module.named_modules(remove_duplicate=False))}
    names = sorted(set(instances[chosen]), key=lambda n: order.get(n, len(order)))
    outer = [n for n in names if not any(n.startswith(other + ".") for other in names)]
    return _blocks_cut(outer)


def _pp_plan(module: nn.Module) -> dict[str, object]:
    """A Hugging Face model's pipeline plan with keys relative to ``module``, or ``{}``."""
    plan = getattr(module, "_pp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(module, "base_model", None)
    prefix = getattr(module, "base_model_prefix", "")
    if base is not None and base is not module and prefix and hasattr(module, prefix):
        inner = getattr(base, "_pp_plan", None) or getattr(
            getattr(module, "config", None), "base_model_pp_plan", None
        )
        if inner:
            return {f"{prefix}.{key}": value for key, value in inner.items()}
    inner = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
    return dict(inner) if inner else {}


def pp_plan_cuts(module: nn.Module) -> list[Cut]:
    """Cuts from a Hugging Face model's own pipeline plan (``_pp_plan`` or the config's
    ``base_model_pp_plan``): around each entry of the plan's ``nn.ModuleList``s (the decoder
    layers), the plan's other modules (embeddings, final norm, head) joining their neighbours.

    Returns:
        The cuts, or ``[]`` where the model ships no plan.
    """
    names: list[str] = []
    for key in _pp_plan(module):
        try:
            sub = module.get_submodule(key)
        except AttributeError:
            continue
        if isinstance(sub, nn.ModuleList):
            names += [f"{key}.{child}" for child in sub._modules]
    return _blocks_cut(names)


#: a block's child holding less than this share of the block's parameters (a norm, a dropout)
#: is not cut before: it stays with the module after it, whose input it makes
LIGHT = 0.01


def _inner_cut(block: nn.Module) -> str | None:
    """The child of ``block`` to cut before so that each part holds about half the block's
    parameters (children in the order the block registers them), moved back over the light
    children just before it (a norm goes with the module it feeds); None where the block has
    fewer than two children holding parameters."""
    children = list(block.named_children())
    sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
    total = sum(sizes)
    heavy = [k for k, size in enumerate(sizes) if size >= LIGHT * total and total > 0]
    if len(heavy) < 2:
        return None
    best = min(heavy[1:], key=lambda k: abs(sum(sizes[:k]) - total / 2))
    while best > 0 and sizes[best - 1] < LIGHT * total:
        best -= 1
    return children[best][0] if best > 0 else None


def halved(module: nn.Module, cuts: Sequence[Cut]) -> tuple[list[Cut], str | None]:
    """``cuts`` (before each block and after the last, as :func:`block_cuts` or
    :func:`pp_plan_cuts` give them) with one more inside each block, before the child that
    splits its parameters about in half (a GPT block's second norm, before its MLP), and the
    name of that child in the first block; ``cuts`` unchanged and None where a block has no
    such child. Where P does not divide the blocks, whole blocks leave some stages a block
    more than others, and every schedule steps at the busiest stage's pace; halves even it out.

    Example:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm, self.attn = nn.LayerNorm(64), nn.Linear(64, 192)
        ...         self.norm2, self.mlp = nn.LayerNorm(64), nn.Linear(64, 256)
        >>> net = nn.Module()
        >>> net.blocks = nn.ModuleList(Block() for _ in range(2))
        >>> cuts, inside = halved(net, block_cuts(net))
        >>> [str(c) for c in cuts], inside
        (["before 'blocks.0'", "before 'blocks.0.norm2'", "before 'blocks.1'", \
"before 'blocks.1.norm2'", "after 'blocks.1'"], 'norm2')
    """
    out: list[Cut] = []
    first: str | None = None
    for cut in cuts:
        out.append(cut)
        if cut.after:
            continue
        inner = _inner_cut(module.get_submodule(cut.module))
        if inner is None:
            return list(cuts), None
        first = first or inner
        out.append(Cut(f"{cut.module}.{inner}"))
    return out, first
