"""What the fair protocol compares: the (P, N) grid, the schedules and correction variants, one job
and its stored result, gpipe's best-case N.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipemare import PipeMareConfig
from pipemare.experiments.studies.protocol import RunResult, Task

#: (P, N): the practical regime (N = 4, 8 at P = 8; N = 4 at P = 16) and the fine-grained one
#: (N = 1, one stage per layer-group).
GRID: tuple[tuple[int, int], ...] = ((8, 1), (8, 4), (8, 8), (16, 1), (16, 4))


_ALONE = {
    "lr_reschedule": False,
    "weight_prediction": False,
    "spike_compensation": False,
    "delay_momentum": None,
    "stability_guard": False,
}


#: T3's synchronous steps in the horizon study (experiments/studies/horizon.py): 5%, 10%, 20%
#: and a third of its 2,400 steps
T3_HORIZON = (120, 240, 480, 800)

#: variant -> (schedule, config); ``pipemare`` is the schedule's default, the others take
#: its corrections one at a time (the ablation behind the default).
VARIANTS: dict[str, tuple[str, PipeMareConfig | None]] = {
    "gpipe": ("gpipe", None),
    "async": ("async", None),
    "pipemare": ("pipemare", None),
    "pipemare-T1T2": ("pipemare", PipeMareConfig.t1_t2()),
    "pipemare-T1": ("pipemare", PipeMareConfig(**{**_ALONE, "lr_reschedule": True})),
    "pipemare-SC": ("pipemare", PipeMareConfig(**{**_ALONE, "spike_compensation": True})),
    "pipemare-WP": ("pipemare", PipeMareConfig(**{**_ALONE, "weight_prediction": True})),
    "pipemare-SC-WP": (
        "pipemare",
        PipeMareConfig(**{**_ALONE, "spike_compensation": True, "weight_prediction": True}),
    ),
    # Ajanthan et al.'s Nesterov method without a stash: momentum rising with the delay, the
    # look-ahead from weight prediction
    "pipemare-WP-DM": (
        "pipemare",
        PipeMareConfig(**{**_ALONE, "weight_prediction": True, "delay_momentum": 0.99}),
    ),
    # T1, spike compensation and weight prediction: the default without delay-aware momentum
    # and the stability guard
    "pipemare-T1-SC-WP": (
        "pipemare",
        PipeMareConfig(delay_momentum=None, stability_guard=False),
    ),
    # PACI's local gradient accumulation (each gradient crosses one update) with T1 and the guard
    "pipemare-LA": ("pipemare", PipeMareConfig(local_accumulation=1)),
    # the same with each gradient crossing up to two and four updates (k = ceil(τ/c) halves,
    # quarters): more updates per stage, for Adam, whose step does not grow with the sum
    "pipemare-LA2": ("pipemare", PipeMareConfig(local_accumulation=2)),
    "pipemare-LA4": ("pipemare", PipeMareConfig(local_accumulation=4)),
    # the default without the stability guard
    "pipemare-noguard": ("pipemare", PipeMareConfig(stability_guard=False)),
    # Zmushko et al.'s error feedback (c = 1) alone, and added to the default
    "pipemare-EF": ("pipemare", PipeMareConfig(**_ALONE, error_feedback=1.0)),
    "pipemare+EF": ("pipemare", PipeMareConfig(error_feedback=1.0)),
    # the same with c = τ_i per stage (the delay's own length)
    "pipemare+EFdelay": ("pipemare", PipeMareConfig(error_feedback="delay")),
    # weight prediction looking twice as far ahead as the delay
    "pipemare+lookahead2": ("pipemare", PipeMareConfig(prediction_scale=2.0)),
    # T3: the first 30 steps synchronous (the compute-bound GPT's warm-up, a tenth of its run)
    "pipemare+T3w30": ("pipemare", PipeMareConfig(warmup_steps=30)),
    # T3 over 5%, 10%, 20% and a third of issue 61's 2,400-step horizon runs
    **{f"pipemare+T3w{k}": ("pipemare", PipeMareConfig(warmup_steps=k)) for k in T3_HORIZON},
    # the default with delay-aware momentum rising with the delay itself, not its share
    "pipemare-DMwindow": ("pipemare", PipeMareConfig(delay_momentum_rise="window")),
    "pipemare-DMstretch": ("pipemare", PipeMareConfig(delay_momentum_rise="stretch")),
    "pipemare-DMdepth": ("pipemare", PipeMareConfig(delay_momentum_rise="depth")),
    # the most delayed stage gets the top momentum at any N (Ajanthan et al.'s share)
    "pipemare-DMshare": ("pipemare", PipeMareConfig(delay_momentum_rise="share")),
    # the default without delay-aware momentum (Adam in a rotated basis, where it hurt on the
    # misaligned quadratic)
    "pipemare-noDM": ("pipemare", PipeMareConfig(delay_momentum=None)),
    # delay-aware momentum asked for by value: on for Muon too, where "auto" leaves it off
    "pipemare-DM": ("pipemare", PipeMareConfig(delay_momentum=0.99)),
    # T1 and the guard only: what is left of the default for an optimiser nearly insensitive
    # to delay (Muon), without delay-aware momentum and weight prediction
    "pipemare-T1G": (
        "pipemare",
        PipeMareConfig(delay_momentum=None, weight_prediction=False, spike_compensation=False),
    ),
    # T1 relaxing over half the run whatever the optimiser and N (the default's choice for the
    # Adam family at N = 1), and over 13% of it always (the default's choice before "auto")
    "pipemare-T1half": ("pipemare", PipeMareConfig(reschedule_fraction=0.5)),
    "pipemare-T1short": ("pipemare", PipeMareConfig(reschedule_fraction=0.13)),
    # the default less one correction at a time ("-noDM" and "-noguard" above are two more):
    # the ablation of issue 40 at P = 2, docs/results.md
    "pipemare-noT1": ("pipemare", PipeMareConfig(lr_reschedule=False)),
    "pipemare-noWP": ("pipemare", PipeMareConfig(weight_prediction=False)),
    "pipemare-noSC": ("pipemare", PipeMareConfig(spike_compensation=False)),
    # delay-aware momentum and the stability guard each alone, as the default resolves them
    # (the other corrections alone: "-T1", "-WP", "-SC", "-EF")
    "pipemare-DMalone": ("pipemare", PipeMareConfig(**{**_ALONE, "delay_momentum": "auto"})),
    "pipemare-guard": ("pipemare", PipeMareConfig(**{**_ALONE, "stability_guard": True})),
}


#: what the protocol compares unless told otherwise
DEFAULT_VARIANTS = ("gpipe", "async", "pipemare", "pipemare-T1-SC-WP")


SYNC = ("gpipe",)


@dataclasses.dataclass(frozen=True)
class Job:
    task: str
    variant: str
    stages: int
    microbatches: int
    lr: float
    seed: int
    steps: int | None = None
    #: told apart from the job of the same configuration at the task's length (e.g. a run
    #: given another schedule's pipeline time: ``"-time420"``)
    suffix: str = ""

    @property
    def key(self) -> str:
        return (
            f"{self.task}-{self.variant}-P{self.stages}-N{self.microbatches}"
            f"-lr{self.lr:g}-s{self.seed}{self.suffix}"
        )


def load_result(out: Path, job: Job) -> RunResult:
    """The result ``job`` stored under ``out/runs``."""
    return RunResult(**json.loads((out / "runs" / f"{job.key}.json").read_text()))


def best_case_n(task: Task, stages: int) -> int:
    """gpipe's and 1f1b's N of least bubble: 4P, or as many as the minibatch has samples."""
    return min(4 * stages, task.batch)
