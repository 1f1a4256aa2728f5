"""What a run derives from its length, kept by a resume: a resumed run continues the same run.

T1's horizon K is, by default, a fraction of the run's steps (:meth:`PipeMareConfig.horizon`),
so resuming a checkpoint with another ``max_steps`` would silently move every later step's
learning rate. The checkpoint therefore stores the horizon with what it was derived from, and a
resume keeps it as long as the config's own settings for it are unchanged; where the user did
change them (``reschedule_steps``, ``reschedule_epochs``, ``reschedule_fraction``,
``warmup_steps``) the new horizon applies. Either way a difference is returned as a note for
the caller to announce, naming the old and the new value. Nothing else the corrections do
depends on the run's length (the warm-up is given in steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from pipemare.optim.config import PipeMareConfig
from pipemare.optim.corrections import Correction, LRReschedule

__all__ = ["keep_horizon", "rederive", "run_state"]

#: The config's fields T1's horizon depends on, besides the run's length.
SETTINGS = ("reschedule_steps", "reschedule_epochs", "reschedule_fraction", "warmup_steps")


def _t1(corrections: Sequence[Correction]) -> LRReschedule | None:
    return next((c for c in corrections if isinstance(c, LRReschedule)), None)


def run_state(
    config: PipeMareConfig,
    corrections: Sequence[Correction],
    total_steps: int | None,
    steps_per_epoch: int | None,
    optimizer: torch.optim.Optimizer | None = None,
    microbatches: int = 1,
) -> dict[str, Any]:
    """What to store in a checkpoint: T1's horizon (None without T1) and what it came from
    (``reschedule_fraction="auto"`` as resolved for ``optimizer`` and ``microbatches``).

    Example:
        >>> cfg = PipeMareConfig()
        >>> run_state(cfg, cfg.build(total_steps=30), 30, 8)["horizon"]
        4
    """
    t1 = _t1(corrections)
    settings = {name: getattr(config, name) for name in SETTINGS}
    settings["reschedule_fraction"] = config.fraction(optimizer, microbatches)
    return {
        "horizon": None if t1 is None else t1.horizon,
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "settings": settings,
    }


def rederive(
    config: PipeMareConfig,
    corrections: Sequence[Correction],
    state: dict[str, Any],
    total_steps: int,
) -> tuple[dict[str, Any], int | None]:
    """T1's horizon derived again for a run now known to be ``total_steps`` long (a run that a
    pipeline-time budget will stop before ``max_steps``), where it is a fraction of the run.

    Returns the run state to keep, and the new horizon (None where T1 is off or its horizon is
    given in steps or epochs, which the run's length does not move).

    Example:
        >>> cfg = PipeMareConfig()
        >>> t1s = cfg.build(total_steps=1000)
        >>> state, horizon = rederive(cfg, t1s, run_state(cfg, t1s, 1000, 8), 400)
        >>> horizon, t1s[0].horizon, state["total_steps"]
        (52, 52, 400)
    """
    t1, settings = _t1(corrections), state["settings"]
    if t1 is None or (settings["reschedule_steps"], settings["reschedule_epochs"]) != (None,) * 2:
        return state, None
    fraction = dataclasses.replace(config, reschedule_fraction=settings["reschedule_fraction"])
    t1.horizon = fraction.horizon(total_steps)
    return {**state, "horizon": t1.horizon, "total_steps": total_steps}, t1.horizon


def _basis(state: dict[str, Any]) -> str:
    """In words, what a horizon was derived from."""
    settings = state["settings"]
    if settings["reschedule_steps"] is not None:
        return f"reschedule_steps={settings['reschedule_steps']}"
    if settings["reschedule_epochs"] is not None:
        return f"{settings['reschedule_epochs']:g} epochs of {state['steps_per_epoch']} steps"
    if state["total_steps"] is None:
        return "no known run length"
    warmup = settings["warmup_steps"]
    after = f" after {warmup} warm-up steps" if warmup else ""
    return f"{settings['reschedule_fraction']:g} of the run's {state['total_steps']} steps{after}"


def keep_horizon(
    corrections: Sequence[Correction], saved: dict[str, Any], now: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Set T1's horizon to the one ``saved`` unless the config's settings for it changed since.

    Args:
        corrections: this run's corrections (T1's horizon is set in place).
        saved: the checkpointed run's :func:`run_state`.
        now: this run's own :func:`run_state`, as it would run without the checkpoint.

    Returns:
        The run state this run now stands on (``saved`` where its horizon is kept, so the
        run's next checkpoints name what the horizon came from), and a note naming the old and
        the new value where they differ.

    Example:
        >>> cfg = PipeMareConfig()
        >>> saved = run_state(cfg, cfg.build(total_steps=30), 30, 8)
        >>> longer = cfg.build(total_steps=60)
        >>> state, (note,) = keep_horizon(longer, saved, run_state(cfg, longer, 60, 8))
        >>> longer[0].horizon, state["total_steps"], note[:48]
        (4, 30, "T1's horizon stays 4 steps, as the checkpointed ")
    """
    t1 = _t1(corrections)
    old = saved.get("horizon")
    if t1 is None or old is None:
        return now, []  # T1 off now or then: the layout notes say it starts afresh
    changed = [k for k in SETTINGS if saved["settings"].get(k) != now["settings"][k]]
    if not changed:
        t1.horizon = old
        if now["horizon"] == old:
            return saved, []
        return saved, [
            f"T1's horizon stays {old} steps, as the checkpointed run derived it "
            f"({_basis(saved)}); this run's length ({_basis(now)}) would give {now['horizon']}; "
            f"to change it set PipeMareConfig(reschedule_steps={now['horizon']})"
        ]
    if now["horizon"] == old:
        return now, []
    was = saved["settings"]
    what = ", ".join(f"{k} from {was.get(k)!r} to {now['settings'][k]!r}" for k in changed)
    return now, [
        f"T1's horizon changes from {old} steps ({_basis(saved)}) to {now['horizon']} steps "
        f"({_basis(now)}): the config changed {what}"
    ]
