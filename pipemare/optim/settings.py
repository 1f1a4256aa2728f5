"""The run's settings, resolved once: the corrections that run, their settings, and why.

:func:`resolve` is the one place that turns what the user asked (a
:class:`~pipemare.optim.config.PipeMareConfig` and its ``"auto"`` fields, or none) into what the
run does, for the schedule, the layout, the optimiser and the run's length. It returns a frozen
:class:`RunSettings`: every correction that runs with its settings, T1's horizon, and each
decision taken on the user's behalf with its reason. The corrections are built from it
(:meth:`RunSettings.build`) and never decide again; a run whose length becomes known later (a
time budget) or that continues a checkpoint gets a new :class:`RunSettings` from
:meth:`RunSettings.for_run_length` or :meth:`RunSettings.resumed`.

The defaults and their measurements:

- a schedule's own default: ``pipemare`` runs :class:`PipeMareConfig`'s defaults, every other
  schedule (``async``, ``pipedream``, ``1f1b``, ``gpipe``) none
  (:attr:`~pipemare.schedule.actions.ScheduleSpec.corrected`);
- T1's horizon as a fraction of the run (:data:`AUTO_FRACTIONS`, docs/results.md), or
  :data:`FALLBACK_HORIZON` steps where the run's length is unknown;
- delay-aware momentum up to :data:`AUTO_DELAY_MOMENTUM` (Ajanthan et al., ICML 2025), off for
  Muon (measured better off), without momentum and where summed and averaged momenta mix;
- spike compensation where the optimiser is one it supports
  (:func:`~pipemare.optim.corrections.spike.unsupported`);
- weight prediction unless T2, local accumulation or a stashing schedule excludes it, or the
  optimiser is SGD without momentum (where it narrows the stable step range);
- local accumulation (one update crossed) for SGD without momentum only.

The layout (P, N, the cut) is decided before, by :func:`pipemare.planner.decide.decide`, which
calls this function for the corrections.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipemare.lines import DECISIONS, text
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.corrections import (
    Correction,
    DelayMomentum,
    DiscrepancyCorrection,
    ErrorFeedback,
    LocalAccumulation,
    LRReschedule,
    SpikeCompensation,
    StabilityGuard,
    WeightPrediction,
)
from pipemare.optim.corrections import lr_reschedule as t1
from pipemare.optim.corrections.base import (
    group_momentum,
    is_muon,
    is_plain_sgd,
    momentum_is_average,
)
from pipemare.optim.corrections.lr_reschedule import AUTO_FRACTIONS, FALLBACK_HORIZON
from pipemare.optim.corrections.spike import unsupported
from pipemare.schedule.actions import spec
from pipemare.schedule.delay import StageDelay, derive_delays

__all__ = [
    "AUTO_DELAY_MOMENTUM",
    "AUTO_FRACTIONS",
    "FALLBACK_HORIZON",
    "CorrectionSettings",
    "Decision",
    "RunSettings",
    "asked",
    "check_for_schedule",
    "resolve",
]

#: ``delay_momentum="auto"``'s momentum at the most delayed stage (Ajanthan et al., ICML 2025).
AUTO_DELAY_MOMENTUM = 0.99

#: The config's fields T1's horizon depends on, besides the run's length (a resume keeps the
#: checkpointed horizon while these are unchanged).
HORIZON_FIELDS = ("reschedule_steps", "reschedule_epochs", "reschedule_fraction", "warmup_steps")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice taken on the user's behalf (an ``"auto"``, a schedule's default), and why.

    Example:
        >>> str(Decision("weight_prediction", "off", "SGD without momentum"))
        'weight_prediction: off (SGD without momentum)'
    """

    subject: str
    choice: str
    reason: str

    def __post_init__(self) -> None:
        # every decision line is documented: its subject is one of the reference's
        if self.subject not in DECISIONS:
            raise ValueError(
                f"decision subject {self.subject!r} is not in pipemare.lines.DECISIONS"
            )

    def __str__(self) -> str:
        return f"{self.subject}: {self.choice} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class CorrectionSettings:
    """One correction that runs: its name, its settings and the first step it acts on.

    Example:
        >>> CorrectionSettings("delay_momentum", (("max", 0.99), ("rise", "depth"))).describe()
        'delay_momentum(max=0.99, rise=depth)'
    """

    name: str
    settings: tuple[tuple[str, Any], ...] = ()
    start: int = 0

    def __getitem__(self, key: str) -> Any:
        return dict(self.settings)[key]

    def describe(self) -> str:
        """``name(key=value, ...)``, as the run's log shows it."""
        shown = ", ".join(
            f"{k}={v}" if isinstance(v, str) else f"{k}={v:g}" for k, v in self.settings
        )
        return f"{self.name}({shown})" if shown else self.name


# How each correction is built from its settings: one row per correction.
_BUILDERS: dict[str, Callable[[CorrectionSettings], Correction]] = {
    "lr_reschedule": lambda c: LRReschedule(c["horizon"], c.start),
    "delay_momentum": lambda c: DelayMomentum(c["max"], c.start, rise=c["rise"]),
    "spike_compensation": lambda c: SpikeCompensation(c.start),
    "discrepancy_correction": lambda c: DiscrepancyCorrection(c["decay"]),
    "weight_prediction": lambda c: WeightPrediction(c["decay"], c["scale"]),
    "error_feedback": lambda c: ErrorFeedback(
        "delay" if "c_per_delay" in dict(c.settings) else c["c"], c.start
    ),
    "local_accumulation": lambda c: LocalAccumulation(c["crossed"], c.start),
    "stability_guard": lambda c: StabilityGuard(c["threshold"], start=c.start),
}


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a run does, resolved once by :func:`resolve`; printed, checkpointed, never re-decided.

    Attributes:
        schedule: the schedule's name.
        stages: P.
        microbatches: N.
        replicas: D, data-parallel copies of the pipeline.
        balance: layers per stage, where the cut is known.
        config: the corrections asked for (the schedule's default where none was given).
        corrections: those that run, in the order their hooks run.
        decisions: each choice taken on the user's behalf, with its reason.
        horizon: T1's horizon K in optimiser steps (None without T1).
        total_steps: the run's optimiser steps T1's horizon was derived from, where known.
        steps_per_epoch: optimiser steps per epoch, where known.
        fraction: T1's horizon as a fraction of the run, ``"auto"`` resolved.
        delays: every stage's delays (:func:`~pipemare.schedule.delay.derive_delays`).
    """

    schedule: str
    stages: int
    microbatches: int
    replicas: int
    balance: tuple[int, ...] | None
    config: PipeMareConfig
    corrections: tuple[CorrectionSettings, ...]
    decisions: tuple[Decision, ...]
    horizon: int | None
    total_steps: int | None
    steps_per_epoch: int | None
    fraction: float
    delays: tuple[StageDelay, ...] = dataclasses.field(repr=False, compare=False, default=())

    def correction(self, name: str) -> CorrectionSettings | None:
        """The settings of the correction called ``name``, or None where it does not run."""
        return next((c for c in self.corrections if c.name == name), None)

    @property
    def predicts(self) -> bool:
        """Whether forwards run at predicted weights (weight prediction runs)."""
        return self.correction("weight_prediction") is not None

    @property
    def warmup_steps(self) -> int:
        """T3: the first optimiser steps run by a synchronous pipeline."""
        return self.config.warmup_steps

    def describe(self) -> str:
        """The corrections that run and their settings, e.g. ``lr_reschedule(horizon=130),
        stability_guard(threshold=3)``; empty without any."""
        return ", ".join(c.describe() for c in self.corrections)

    def layout(self) -> str:
        """The schedule and layout in words."""
        cut = "" if self.balance is None else f", layers per stage {list(self.balance)}"
        copies = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return f"schedule {self.schedule!r}, P={self.stages}{copies}, N={self.microbatches}{cut}"

    def lines(self) -> list[str]:
        """The run's settings in lines for its log: the layout, the corrections, then every
        decision taken on the user's behalf with its reason."""
        out = [self.layout(), f"corrections: {self.describe() or 'none'}"]
        out += [f"  {d}" for d in self.decisions]
        return out

    def build(self) -> list[Correction]:
        """The corrections, built from these settings (they decide nothing themselves)."""
        return [_BUILDERS[c.name](c) for c in self.corrections]

    def to_dict(self) -> dict[str, Any]:
        """A plain form for checkpoints and run configs."""
        return {
            "layout": self.layout(),
            "corrections": self.describe(),
            "decisions": [str(d) for d in self.decisions],
        }

    def run_state(self) -> dict[str, Any]:
        """What a checkpoint stores of the run's length: T1's horizon and what it came from
        (a resume keeps it: :meth:`resumed`), and the settings in words."""
        settings: dict[str, Any] = {k: getattr(self.config, k) for k in HORIZON_FIELDS}
        settings["reschedule_fraction"] = self.fraction
        return {
            "horizon": self.horizon,
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "settings": settings,
            "resolved": self.to_dict(),
        }

    def _with_horizon(self, horizon: int, decision: Decision, **fields: Any) -> RunSettings:
        """These settings with T1's horizon (and ``fields``) replaced, and why."""
        t1 = self.correction("lr_reschedule")
        assert t1 is not None
        new_t1 = dataclasses.replace(t1, settings=(("horizon", horizon),))
        corrections = tuple(new_t1 if c is t1 else c for c in self.corrections)
        decisions = tuple(d for d in self.decisions if d.subject != "lr_reschedule horizon")
        return dataclasses.replace(
            self,
            corrections=corrections,
            decisions=(*decisions, decision),
            horizon=horizon,
            **fields,
        )

    def for_run_length(self, total_steps: int) -> RunSettings:
        """These settings for a run now known to be ``total_steps`` long (a time budget that
        stops it before ``max_steps``): T1's horizon derived again where it is a fraction of
        the run; unchanged where T1 is off or its horizon is given in steps or epochs.

        Example:
            >>> import torch
            >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            >>> s = resolve(None, sgd, stages=4, total_steps=1000)
            >>> s.horizon, s.for_run_length(400).horizon
            (130, 52)
        """
        if self.horizon is None or not self._horizon_follows_length():
            return self
        horizon = t1.fraction_horizon(self.fraction, total_steps, self.config.warmup_steps)
        why = f"{self.fraction:g} of the {total_steps} steps the run is now expected to last"
        return self._with_horizon(
            horizon,
            Decision("lr_reschedule horizon", f"{horizon} steps", why),
            total_steps=total_steps,
        )

    def _horizon_follows_length(self) -> bool:
        return self.config.reschedule_steps is None and self.config.reschedule_epochs is None

    def resumed(self, saved: Mapping[str, Any]) -> tuple[RunSettings, list[str]]:
        """These settings continuing the checkpointed run whose :meth:`run_state` is ``saved``.

        T1's horizon is the saved run's as long as the config's settings for it
        (:data:`HORIZON_FIELDS`) are unchanged, so a resume with another ``max_steps`` does not
        move every later step's rate; where the user changed them, this run's applies.

        Returns:
            The settings to run with, and a note naming the old and the new horizon where
            they differ (for the caller to announce).
        """
        old = saved.get("horizon")
        if self.horizon is None or old is None:
            return self, []  # T1 off now or then: the layout notes say it starts afresh
        was = saved["settings"]
        now = self.run_state()["settings"]
        changed = [k for k in HORIZON_FIELDS if was.get(k) != now[k]]
        if changed:
            if self.horizon == old:
                return self, []
            what = ", ".join(f"{k} from {was.get(k)!r} to {now[k]!r}" for k in changed)
            return self, [
                f"T1's horizon changes from {old} steps ({t1.horizon_basis(saved)}) to "
                f"{self.horizon} steps ({t1.horizon_basis(self.run_state())}): the config "
                f"changed {what}"
            ]
        kept = self._with_horizon(
            old,
            Decision(
                "lr_reschedule horizon",
                f"{old} steps",
                f"the checkpointed run's ({t1.horizon_basis(saved)})",
            ),
            total_steps=saved["total_steps"],
            steps_per_epoch=saved["steps_per_epoch"],
        )
        if self.horizon == old:
            return kept, []
        return kept, [
            f"T1's horizon stays {old} steps, as the checkpointed run derived it "
            f"({t1.horizon_basis(saved)}); this run's length "
            f"({t1.horizon_basis(self.run_state())}) would give {self.horizon}; to change it "
            f"set PipeMareConfig(reschedule_steps={self.horizon})"
        ]


def asked(config: PipeMareConfig | None, schedule: str) -> PipeMareConfig:
    """The corrections asked for: ``config``, or the schedule's default where it is None
    (``pipemare``: :class:`PipeMareConfig`'s defaults; the other schedules: none).

    Example:
        >>> asked(None, "async") == PipeMareConfig.off(), asked(None, "pipemare").lr_reschedule
        (True, True)
    """
    if config is not None:
        return config
    return PipeMareConfig() if spec(schedule).corrected else PipeMareConfig.off()


def check_for_schedule(config: PipeMareConfig, schedule: str) -> None:
    """Refuse a config the schedule cannot run, whatever the optimiser (at setup, before
    anything runs): weight prediction asked for on a stashing schedule."""
    if spec(schedule).stashes and config.weight_prediction is True:
        raise ValueError(
            f"weight_prediction cannot run with {schedule!r}: its backward uses the stashed "
            "forward weights, not the predicted ones; use schedule='async' or 'pipemare', or "
            "weight_prediction='auto'"
        )


class _Resolution:
    """The decisions of one :func:`resolve` call, gathered as they are taken."""

    def __init__(self, config: PipeMareConfig, optimizer: torch.optim.Optimizer) -> None:
        self.config, self.optimizer = config, optimizer
        self.groups = optimizer.param_groups
        self.corrections: list[CorrectionSettings] = []
        self.decisions: list[Decision] = []
        self.accumulates = config.local_accumulation not in (None, "auto")

    def run(self, name: str, start: int = 0, **settings: Any) -> None:
        self.corrections.append(CorrectionSettings(name, tuple(settings.items()), start))

    def decide(self, subject: str, choice: str, reason: str) -> None:
        self.decisions.append(Decision(subject, choice, reason))

    def yields_to_accumulation(self, subject: str) -> bool:
        """Whether an ``"auto"`` correction stands aside for local accumulation asked for by
        number (it counts several minibatches per update; the others count one); says so."""
        if self.accumulates:
            self.decide(subject, "off", "local accumulation counts several minibatches per update")
        return self.accumulates


def _lr_reschedule(
    r: _Resolution,
    fraction: tuple[float, str],
    total_steps: int | None,
    steps_per_epoch: int | None,
) -> int | None:
    """T1 runs with its horizon (:func:`~pipemare.optim.corrections.lr_reschedule.horizon`)."""
    if not r.config.lr_reschedule:
        return None
    k, why = t1.horizon(r.config, fraction, total_steps, steps_per_epoch)
    if why is not None:
        r.decide("lr_reschedule horizon", f"{k} steps", why)
    r.run("lr_reschedule", r.config.warmup_steps, horizon=k)
    return k


def _delay_momentum(r: _Resolution) -> None:
    config, opt, groups = r.config, r.optimizer, r.groups
    dm, start, rise = config.delay_momentum, config.warmup_steps, config.delay_momentum_rise
    if dm is None:
        return
    if dm == "auto" and r.yields_to_accumulation("delay_momentum"):
        return
    averaged = [momentum_is_average(opt, g) for g in groups]
    has_momentum = all("betas" in g or "momentum" in g for g in groups)
    if any(averaged) and not all(averaged):  # e.g. SGD and AdamW, chained
        if dm != "auto":
            raise ValueError(
                "delay_momentum compensates a summed (SGD) momentum by the rate and an "
                "averaged one (Adam, Muon) not at all, per stage; these optimisers mix both"
                ": switch it off (delay_momentum=None) or give every group one kind"
            )
        r.decide("delay_momentum", "off", "the optimiser mixes summed and averaged momentum")
        return
    if dm == "auto":
        # Muon (and the AdamW groups beside it) measured better without it: on 5 of 20
        # protocol cells, worse on 1 (docs/results.md, "Muon + AdamW without delay-aware
        # momentum")
        if any(is_muon(opt, g) for g in groups):
            r.decide("delay_momentum", "off", "Muon: measured better without it")
        elif not (all(averaged) or (has_momentum and group_momentum(groups[0]) > 0.0)):
            r.decide("delay_momentum", "off", "the optimiser has no momentum to raise")
        else:
            r.decide("delay_momentum", f"up to {AUTO_DELAY_MOMENTUM}", "Ajanthan et al., ICML 2025")
            r.run("delay_momentum", start, max=AUTO_DELAY_MOMENTUM, rise=rise)
        return
    if not has_momentum:
        raise ValueError(
            f"delay_momentum needs an optimiser with momentum (SGD, Adam, AdamW, NAdam, ...),"
            f" not {type(opt).__name__}; or switch it off (delay_momentum=None)"
        )
    user = group_momentum(groups[0])
    if float(dm) < user:
        warnings.warn(text("delay_momentum.below", given=dm, own=user), stacklevel=3)
    r.run("delay_momentum", start, max=float(dm), rise=rise)


def _spike_compensation(r: _Resolution) -> None:
    sc = r.config.spike_compensation
    if sc is False or (sc == "auto" and r.yields_to_accumulation("spike_compensation")):
        return
    problem = unsupported(r.optimizer)
    if problem is not None:
        if sc is True:
            raise ValueError(f"{problem}; or switch it off (spike_compensation=False)")
        r.decide("spike_compensation", "off", problem)
        return
    if sc == "auto":
        r.decide("spike_compensation", "on", "the optimiser is one it supports")
    r.run("spike_compensation", r.config.warmup_steps)


def _weight_prediction(r: _Resolution, stashes: bool) -> None:
    config = r.config
    wp = config.weight_prediction
    if wp is False:
        return
    if wp == "auto":
        if config.discrepancy_correction:
            r.decide("weight_prediction", "off", "T2 corrects the backward instead")
            return
        if r.yields_to_accumulation("weight_prediction"):
            return
        if stashes:
            r.decide("weight_prediction", "off", "the schedule stashes the forward's weights")
            return
        if is_plain_sgd(r.optimizer):
            r.decide(
                "weight_prediction", "off", "SGD without momentum: it narrows the stable step range"
            )
            return
        r.decide("weight_prediction", "on", "runs each forward at the weights its update meets")
    r.run("weight_prediction", decay=config.prediction_decay, scale=config.prediction_scale)


def _local_accumulation(r: _Resolution) -> None:
    config, la = r.config, r.config.local_accumulation
    if isinstance(la, int) and not isinstance(la, bool):
        r.run("local_accumulation", config.warmup_steps, crossed=la)
    elif la == "auto":
        named = config.per_minibatch_named()
        if named:
            r.decide("local_accumulation", "off", f"excluded by {', '.join(named)}, asked for")
        elif is_plain_sgd(r.optimizer):
            r.decide("local_accumulation", "on (c = 1)", "SGD without momentum: no other serves it")
            r.run("local_accumulation", config.warmup_steps, crossed=1)
        else:
            r.decide("local_accumulation", "off", "only SGD without momentum is served by it")


def resolve(
    config: PipeMareConfig | None,
    optimizer: torch.optim.Optimizer,
    *,
    schedule: str = "pipemare",
    stages: int | None = None,
    microbatches: int = 1,
    delays: Sequence[StageDelay] | None = None,
    replicas: int = 1,
    balance: Sequence[int] | None = None,
    total_steps: int | None = None,
    steps_per_epoch: int | None = None,
    layout: Sequence[Decision] = (),
) -> RunSettings:
    """The run's settings: what runs, with which settings, and why (see the module).

    Args:
        config: the corrections asked for; None: the schedule's default.
        optimizer: the user's optimiser (its param groups decide the ``"auto"`` fields).
        schedule: the schedule's name.
        stages: P (default: the number of ``delays``).
        microbatches: N.
        delays: every stage's delays (default: derived from the schedule, P and N).
        replicas: D.
        balance: layers per stage, where the cut is known.
        total_steps: the run's optimiser steps, where known (T1's horizon).
        steps_per_epoch: optimiser steps per epoch, where known (T1's horizon in epochs).
        layout: how the caller chose P and the cut where the user did not (measured at the
            first batch: the layers' times, the planner's profile), recorded first.

    Raises:
        ValueError: a correction asked for by name that cannot run here (with what to do).

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> s = resolve(None, sgd, stages=4, total_steps=1000)
        >>> [c.name for c in s.corrections]
        ['lr_reschedule', 'spike_compensation', 'local_accumulation', 'stability_guard']
        >>> print(s.decisions[-1])
        local_accumulation: on (c = 1) (SGD without momentum: no other serves it)
    """
    sp = spec(schedule)
    if delays is None:
        if stages is None:
            raise ValueError("resolve needs the number of stages or every stage's delays")
        delays = derive_delays(schedule, stages, microbatches)
    r_decisions: list[Decision] = list(layout)
    if config is None:
        config = asked(None, schedule)
        what = "PipeMare's corrections" if sp.corrected else "none"
        r_decisions.append(Decision("corrections", what, f"the default of schedule {schedule!r}"))
    else:
        check_for_schedule(config, schedule)
        config = dataclasses.replace(config)  # the user's may change later; these may not
    r = _Resolution(config, optimizer)
    r.decisions += r_decisions
    fraction = t1.horizon_fraction(config, optimizer, microbatches)
    horizon = _lr_reschedule(r, fraction, total_steps, steps_per_epoch)
    _delay_momentum(r)
    _spike_compensation(r)
    if config.discrepancy_correction:
        r.run("discrepancy_correction", decay=config.discrepancy_decay)
    _weight_prediction(r, sp.stashes)
    if config.error_feedback is not None:
        ef = config.error_feedback
        coefficient = {"c_per_delay": 1.0} if ef == "delay" else {"c": float(ef)}
        r.run("error_feedback", config.warmup_steps, **coefficient)
    _local_accumulation(r)
    if config.stability_guard:  # its before_step sets the strength the others read after it
        r.run("stability_guard", config.warmup_steps, threshold=config.guard_threshold)
    return RunSettings(
        schedule=schedule,
        stages=len(delays),
        microbatches=microbatches,
        replicas=replicas,
        balance=None if balance is None else tuple(balance),
        config=config,
        corrections=tuple(r.corrections),
        decisions=tuple(r.decisions),
        horizon=horizon,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        fraction=fraction[0],
        delays=tuple(delays),
    )
