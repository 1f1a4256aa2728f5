"""The fair convergence protocol: tasks, one engine run, and its pipeline time.

Every comparison the project publishes is built from :func:`run_task` runs on :data:`TASKS`:
each schedule at its own best learning rate (a small sweep), two or more seeds, runs long
enough that gpipe has plateaued, quality against optimiser steps and against *pipeline time*,
the wall time P devices would take (:func:`step_time`: each stage's measured forward,
backward and update times replayed through the schedule).

Runs use the engine directly (the simulator: every stage in this process, the same staleness
as one process per stage) and evaluate the live weights without draining the pipeline, so
measuring does not change the trajectory.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipemare import NonFiniteGradientError, NonFiniteLossError, Pipeline, PipeMareConfig
from pipemare.engine.link import Link, Links
from pipemare.engine.telemetry import Probe, replay_timeline

__all__ = ["OPTIMIZERS", "TASKS", "RunResult", "Task", "run_setup", "run_task", "step_time"]


@dataclasses.dataclass(frozen=True)
class Task:
    """A model, its offline data and its metric, sized for many runs on a CPU.

    Attributes:
        name: the task's name in tables.
        build: seed -> the ``nn.Sequential`` (at least 16 layers, so P = 16 fits).
        data: ``(x_train, y_train, x_val, y_val)``.
        loss: ``(output, target) -> mean loss``.
        metric: ``"acc"`` (higher is better) or ``"loss"`` (validation loss, lower is better).
        batch: minibatch size.
        steps: optimiser steps per run.
        eval_every: steps between evaluations.
        lrs: the learning rates each schedule is swept over.
        tuned: whether the defaults were chosen on this task (at least one task is not).
        optimizer: what trains it (:data:`OPTIMIZERS`): ``"adam"``, ``"adamw"``, ``"sgd"``,
            ``"sgdm"`` (SGD with heavy-ball momentum 0.9), ``"nesterov"`` (the same with
            Nesterov's), ``"muon"`` (Muon on the hidden matrices, AdamW on the rest, one
            optimiser), ``"rotated"`` (:class:`~pipemare.optim.RotatedAdamW`) or ``"nanogpt"``
            (AdamW as nanoGPT trains: betas 0.9/0.95, weight decay 0.1).
        warmup: the fraction of the run over which the rate rises linearly from its first
            step's share to the full rate (0: none).
        cosine: whether the rate then decays to 0 along a cosine by the run's last step.
    """

    name: str
    build: Callable[[], nn.Sequential]
    data: Callable[[], tuple[torch.Tensor, ...]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric: str
    batch: int
    steps: int
    eval_every: int
    lrs: tuple[float, ...]
    tuned: bool = True
    optimizer: str = "adam"
    warmup: float = 0.0
    cosine: bool = False

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "acc"


def _digits() -> tuple[torch.Tensor, ...]:
    from pipemare.experiments.tasks.data import digits

    return digits()


def _mnist() -> tuple[torch.Tensor, ...]:
    from pipemare.experiments.tasks.data import mnist_subset

    x, y, xv, yv = mnist_subset()
    return x.flatten(1), y, xv.flatten(1), yv


_CONTEXT = 16


def _char_windows(context: int, held_out: int) -> tuple[torch.Tensor, ...]:
    """The standard library's source in windows of ``context`` bytes: the first 90% to train
    on, at most ``held_out`` windows of the rest to validate on."""
    from pipemare.experiments.tasks.data import next_byte_windows, stdlib_corpus

    data = stdlib_corpus()
    cut = int(len(data) * 0.9)
    x, y = next_byte_windows(data[:cut], context)
    xv, yv = next_byte_windows(data[cut:], context, held_out)
    return x, y, xv, yv


_char = functools.partial(_char_windows, _CONTEXT, 512)

#: the compute-bound GPT's context: at 64 tokens a row's forward and backward cost about
#: the same at 32 rows as at 4 (9.1 and 10.0 ms per row at width 128, one thread, this CPU)
_LONG_CONTEXT = 64

_char_long = functools.partial(_char_windows, _LONG_CONTEXT, 256)


def _gpt_c64(blocks: int = 8, halves: bool = False) -> nn.Sequential:
    """A GPT whose stages cost about their rows: ``blocks`` blocks of width 128 at context 64,
    tied head, cut into segments at its blocks (``blocks + 2`` layers: P = 8 cuts from 6), and
    with ``halves`` inside each block too, between its attention and its MLP (``2 * blocks + 2``
    layers: where P does not divide the blocks, the stages come out more even). The cut does
    not change what the model computes: the same weights, the same outputs."""
    from pipemare.experiments.tasks.gpt import GPT
    from pipemare.model.blocks import Cut, block_cuts
    from pipemare.model.segments import segment_module

    model = GPT(256, 128, 4, blocks, _LONG_CONTEXT)
    for module in model.modules():  # nanoGPT's initialisation: logits start near uniform
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
    cuts = block_cuts(model) + ([Cut(f"blocks.{i}.ln_2") for i in range(blocks)] if halves else [])
    return segment_module(
        model, (torch.zeros(2, _LONG_CONTEXT, dtype=torch.long),), split_points=cuts
    )


def _plain_mlp(inputs: int, width: int, layers: int) -> Callable[[], nn.Sequential]:
    def build() -> nn.Sequential:
        from pipemare.experiments.tasks.models import plain_mlp

        return plain_mlp(inputs, 10, width=width, layers=layers)

    return build


def _residual_mlp(inputs: int, width: int, blocks: int) -> Callable[[], nn.Sequential]:
    def build() -> nn.Sequential:
        from pipemare.experiments.tasks.models import residual_mlp

        return residual_mlp(inputs, 10, width=width, blocks=blocks)

    return build


def _char_lm() -> nn.Sequential:
    from pipemare.experiments.tasks.language_models import char_transformer

    return char_transformer(256, 32, 4, 14, _CONTEXT)


def _char_gpt() -> nn.Sequential:
    """A GPT as people write one (blocks in a ModuleList, tied head), cut into segments at its
    blocks: 14 blocks of width 32 as in ``char_lm``, the tie spanning the first and last stage."""
    from pipemare.experiments.tasks.gpt import GPT
    from pipemare.model.segments import segment_module
    from pipemare.optim import muon_param_groups, rotated_param_groups

    model = GPT(256, 32, 4, 14, _CONTEXT)
    segmented = segment_module(model, (torch.zeros(2, _CONTEXT, dtype=torch.long),))
    # the trace keeps the parameters but not their modules' types, which say what Muon takes
    # and what RotatedAdamW leaves unrotated
    segmented.muon_hidden = muon_param_groups(model)[0]["params"]
    segmented.unrotated = rotated_param_groups(model)[1]["params"]
    return segmented


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from pipemare.experiments.tasks.language_models import next_token_loss

    return next_token_loss(logits, targets)


_LRS = (3e-4, 1e-3, 3e-3)


def _digits_task(
    name: str,
    inputs: int,
    data: Callable[[], tuple[torch.Tensor, ...]],
    batch: int,
    tuned: bool = True,
) -> Task:
    """Ten digit classes through a residual MLP of 14 blocks."""
    build, loss = _residual_mlp(inputs, 64, 14), nn.functional.cross_entropy
    return Task(name, build, data, loss, "acc", batch, 1200, eval_every=50, lrs=_LRS, tuned=tuned)


def _split(model: nn.Module, chosen: list[nn.Parameter], key: str, value: bool) -> list[dict]:
    """``model``'s parameters in two groups: ``chosen`` with ``key=value``, the rest with not."""
    mine = {id(p) for p in chosen}
    return [
        {"params": [p for p in model.parameters() if id(p) in mine], key: value},
        {"params": [p for p in model.parameters() if id(p) not in mine], key: not value},
    ]


def _optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "sgdm":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "nesterov":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    if name == "rotated":
        from pipemare.optim import RotatedAdamW, rotated_param_groups

        plain = getattr(model, "unrotated", None)  # a traced model: its original's choice
        if plain is None:
            return RotatedAdamW(rotated_param_groups(model), lr=lr)
        return RotatedAdamW(_split(model, plain, "rotate", False), lr=lr)
    if name == "muon":
        from pipemare.optim import MuonAdamW, muon_param_groups

        hidden = getattr(model, "muon_hidden", None)  # a traced model: its original's choice
        if hidden is None:
            return MuonAdamW(muon_param_groups(model), lr=lr, weight_decay=0.01)
        return MuonAdamW(_split(model, hidden, "use_muon", True), lr=lr, weight_decay=0.01)
    if name == "nanogpt":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}: one of {sorted(OPTIMIZERS)}")


#: optimiser -> the rates a task trained with it is swept over (Muon with Moonlight's scaling
#: takes AdamW's rates)
OPTIMIZERS: dict[str, tuple[float, ...]] = {
    "adam": _LRS,
    "adamw": _LRS,
    "sgd": (3e-3, 1e-2, 3e-2),
    "sgdm": (1e-3, 3e-3, 1e-2),
    "nesterov": (1e-3, 3e-3, 1e-2),
    "muon": _LRS,
    "rotated": _LRS,
    "nanogpt": (1e-3, 3e-3),
}


def _with(task: Task, optimizer: str) -> Task:
    """``task`` trained with ``optimizer``, named ``task@optimizer``."""
    return dataclasses.replace(
        task, name=f"{task.name}@{optimizer}", optimizer=optimizer, lrs=OPTIMIZERS[optimizer]
    )


_GPT_C64 = Task(
    "gpt_c64",
    _gpt_c64,
    _char_long,
    _lm_loss,
    "loss",
    batch=32,
    steps=300,
    eval_every=25,
    lrs=(1e-3, 3e-3),
    tuned=False,
    optimizer="nanogpt",
    warmup=0.1,
    cosine=True,
)
_PLAIN = Task(
    "plain",
    _plain_mlp(64, 64, 16),
    _digits,
    nn.functional.cross_entropy,
    "acc",
    batch=32,
    steps=1200,
    eval_every=50,
    lrs=_LRS,
    tuned=False,
)

TASKS: dict[str, Task] = {
    "mnist": _digits_task("mnist", 784, _mnist, batch=64),
    "char_lm": Task(
        "char_lm", _char_lm, _char, _lm_loss, "loss", batch=16, steps=800, eval_every=50, lrs=_LRS
    ),
    "digits": _digits_task("digits", 64, _digits, batch=32, tuned=False),
    "char_gpt": Task(
        "char_gpt",
        _char_gpt,
        _char,
        _lm_loss,
        "loss",
        batch=16,
        steps=800,
        eval_every=50,
        lrs=_LRS,
        tuned=False,
    ),
    # a plain deep network: 16 Linear+ReLU layers on the digits, no skip connection, no norm
    "plain": _PLAIN,
    # compute-bound: a GPT whose stages cost about their rows, trained the nanoGPT way (AdamW
    # 0.9/0.95, weight decay 0.1, warm-up over the first tenth, cosine decay); no default was
    # chosen on it
    "gpt_c64": _GPT_C64,
    # the same GPT at the main job's size (``pipemare study default``): 6 blocks, half the
    # batch, 240 steps; no default was chosen on it
    "gpt_c64s": dataclasses.replace(
        _GPT_C64,
        name="gpt_c64s",
        build=functools.partial(_gpt_c64, 6),
        batch=16,
        steps=240,
        eval_every=20,
    ),
}
# the main job's GPT cut between each block's attention and its MLP as well: six blocks on four
# or eight stages leave some stage two blocks' work (or one beside an idle one) at the blocks'
# cut; its halves even the stages out. The same model and data: gpt_c64s's one-device curve is
# its too
TASKS["gpt_c64s_halves"] = dataclasses.replace(
    TASKS["gpt_c64s"], name="gpt_c64s_halves", build=functools.partial(_gpt_c64, 6, halves=True)
)
# every task but the language models with SGD momentum and with Muon + AdamW too
for _base in ("mnist", "digits", "plain"):
    for _opt in ("sgdm", "muon"):
        TASKS[f"{_base}@{_opt}"] = _with(TASKS[_base], _opt)
for _base in ("char_lm", "char_gpt"):
    TASKS[f"{_base}@muon"] = _with(TASKS[_base], "muon")
# the GPT as people train one: AdamW (weight decay 0.01)
TASKS["char_gpt@adamw"] = _with(TASKS["char_gpt"], "adamw")
# Adam in a rotated basis (basis rotation, arXiv 2602.03515) where the Adam gaps are largest
for _base in ("char_lm", "char_gpt", "plain"):
    TASKS[f"{_base}@rotated"] = _with(TASKS[_base], "rotated")
# the plain network with every optimiser family
for _opt in ("sgd", "nesterov", "adamw"):
    TASKS[f"plain@{_opt}"] = _with(TASKS["plain"], _opt)


@dataclasses.dataclass
class RunResult:
    """One run's curve: validation metric (and loss) at ``steps``, and the training losses."""

    task: str
    schedule: str
    variant: str
    stages: int
    microbatches: int
    lr: float
    seed: int
    steps: list[int]
    metric: list[float]
    train_loss: list[float]
    seconds: float
    diverged: bool = False
    refused: str | None = None
    """Why the pipeline refused this configuration at setup (a correction the optimiser does
    not support, asked for by name); such a run has no curve."""
    setup: dict[str, Any] | None = None
    """What the run was set up to train (:func:`run_setup`): a stored run whose setup differs
    from what its job resolves to today (a default changed) is trained again. None in runs
    stored before setups were recorded."""

    def best(self, higher: bool) -> float:
        finite = [m for m in self.metric if math.isfinite(m)]
        if not finite:
            return -math.inf if higher else math.inf
        return max(finite) if higher else min(finite)


#: the validation forward's chunk, in rows times positions for token inputs (else rows): a
#: language model's activations for 4,096 positions stay in this machine's caches, where 256
#: rows of 64 positions do not (gpt_c64s's validation pass: 0.59 s in chunks of 64 rows, 1.04 s
#: in chunks of 256, the same loss to the last bit)
EVAL_CHUNK = 4096


def _eval_rows(x: torch.Tensor) -> int:
    """Rows per validation chunk: :data:`EVAL_CHUNK` positions of token inputs, else 256 rows.

    Example:
        >>> _eval_rows(torch.zeros(8, 64, dtype=torch.long)), _eval_rows(torch.zeros(8, 784))
        (64, 256)
    """
    if x.is_floating_point() or x.dim() < 2:
        return 256
    return max(1, EVAL_CHUNK // math.prod(x.shape[1:]))


@torch.no_grad()
def _evaluate(model: nn.Sequential, task: Task, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    outs = [model(xb) for xb in x.split(_eval_rows(x))]
    model.train()
    out = torch.cat(outs)
    if task.metric == "acc":
        return float((out.argmax(-1) == y).float().mean())
    return float(task.loss(out, y))


def _setup(task: Task, schedule: str, steps: int, pipe: Pipeline | str) -> dict[str, Any]:
    resolved = pipe if isinstance(pipe, str) else pipe.optimizer.describe()
    recipe = {"warmup": task.warmup, "cosine": task.cosine} if task.warmup or task.cosine else {}
    return {
        "schedule": schedule,
        "optimizer": task.optimizer,
        "batch": task.batch,
        "steps": steps,
        **recipe,
        # the corrections as resolved for this optimiser, P and N ("auto" settled), or the
        # reason the pipeline refused them
        ("refused" if isinstance(pipe, str) else "corrections"): resolved,
    }


def run_setup(
    task: Task,
    schedule: str,
    stages: int,
    microbatches: int,
    lr: float,
    config: PipeMareConfig | None = None,
    steps: int | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """What :func:`run_task` with these arguments would be set up to train, without training.

    The schedule, the task's optimiser, batch and steps, and the corrections the pipeline
    resolves for them (:meth:`~pipemare.optim.PipeMareOptimizer.describe`), so a changed default
    shows as a changed setup. ``model``: the task's model, built once by the caller (it is
    copied, not changed); built here otherwise.
    """
    import copy

    model = copy.deepcopy(model) if model is not None else task.build()
    try:
        pipe = _pipeline(task, model, schedule, stages, microbatches, lr, config, 0, steps)
    except ValueError as refusal:
        return _setup(task, schedule, steps or task.steps, str(refusal))
    return _setup(task, schedule, steps or task.steps, pipe)


def _pipeline(
    task: Task,
    model: nn.Sequential,
    schedule: str,
    stages: int,
    microbatches: int,
    lr: float,
    config: PipeMareConfig | None,
    seed: int,
    steps: int | None = None,
) -> Pipeline:
    """The pipeline of one run of ``steps`` steps (default: the task's), which its corrections'
    horizons are fractions of."""
    optimizer = _optimizer(task.optimizer, model, lr)
    return Pipeline(
        model,
        optimizer,
        task.loss,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        balance="params",
        config=config,
        seed=seed,
        total_steps=steps or task.steps,
    )


def _recipe(
    task: Task, optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The task's rate schedule over ``steps`` on the user's optimiser (the pipeline records
    each minibatch's rate when it is fed), or None for a constant rate."""
    if not (task.warmup or task.cosine):
        return None
    from pipemare.experiments.tasks.lr_schedules import WarmupCosine

    warm = max(1, round(task.warmup * steps)) if task.warmup else 0
    final = 0.0 if task.cosine else 1.0
    return WarmupCosine(optimizer, lr_warmup_steps=warm, total_steps=steps, final=final)


def run_task(
    task: Task,
    schedule: str,
    stages: int,
    microbatches: int,
    lr: float,
    seed: int,
    config: PipeMareConfig | None = None,
    variant: str = "",
    steps: int | None = None,
) -> RunResult:
    """One run of ``task``: the validation metric every ``eval_every`` steps, live weights.

    A run whose training loss stops being finite, or whose gradients the engine refuses as not
    finite, ends there (its later points are NaN). A configuration the pipeline refuses at setup
    (a correction asked for by name that the task's optimiser does not support) is returned
    with the reason in ``refused`` and no curve, so a study records it and goes on.
    """
    torch.manual_seed(seed)
    model = task.build()
    x, y, xv, yv = task.data()
    result = RunResult(
        task.name, schedule, variant or schedule, stages, microbatches, lr, seed, [], [], [], 0.0
    )
    steps = steps or task.steps
    try:
        pipe = _pipeline(task, model, schedule, stages, microbatches, lr, config, seed, steps)
    except ValueError as refusal:
        result.refused = str(refusal)
        result.setup = _setup(task, schedule, steps, result.refused)
        return result
    result.setup = _setup(task, schedule, steps, pipe)
    rates = _recipe(task, pipe.optimizer.optimizer, steps)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=gen)
    pos = 0
    start = time.perf_counter()
    for k in range(1, steps + 1):
        if pos + task.batch > len(x):
            order, pos = torch.randperm(len(x), generator=gen), 0
        idx = order[pos : pos + task.batch]
        pos += task.batch
        try:
            loss = pipe.step((x[idx], y[idx]))
        except (NonFiniteLossError, NonFiniteGradientError):  # the engine stopped: diverged
            loss = torch.tensor(math.inf)
        if rates is not None:
            rates.step()
        value = float(loss) if loss is not None else math.nan
        result.train_loss.append(value)
        if not math.isfinite(value):
            result.diverged = True
        if k % task.eval_every == 0 or k == steps or result.diverged:
            result.steps.append(k)
            result.metric.append(math.nan if result.diverged else _evaluate(model, task, xv, yv))
        if result.diverged:
            break
    result.seconds = time.perf_counter() - start
    return result


@functools.cache
def _timed_model(name: str) -> nn.Sequential:
    """Task ``name``'s model at seed 0, built once per process for :func:`step_time`, which
    copies it (a traced model takes seconds to build; its weights do not change its timings)."""
    torch.manual_seed(0)
    return TASKS[name].build()


def step_time(
    task: Task,
    schedule: str,
    stages: int,
    microbatches: int,
    config: PipeMareConfig | None = None,
    steps: int = 32,
    warm: int = 8,
    repeats: int = 3,
) -> float:
    """Seconds per optimiser step that P devices would take, in steady state, communication
    free (:func:`step_times` without links)."""
    return step_times(task, schedule, stages, microbatches, config, steps, warm, repeats)["free"]


def step_times(
    task: Task,
    schedule: str,
    stages: int,
    microbatches: int,
    config: PipeMareConfig | None = None,
    steps: int = 32,
    warm: int = 8,
    repeats: int = 3,
    links: Mapping[str, Link] | None = None,
) -> dict[str, float]:
    """Seconds per optimiser step that P devices would take, in steady state: ``"free"``
    (communication free) and one per named link of ``links`` (every link of the pipeline
    that one). One configuration of :func:`interleaved_step_times`."""
    key = (schedule, stages, microbatches)
    return interleaved_step_times(task, [key], config, steps, warm, repeats, links)[key]


def interleaved_step_times(
    task: Task,
    configurations: Sequence[tuple[str, int, int]],
    config: PipeMareConfig | None = None,
    steps: int = 32,
    warm: int = 8,
    repeats: int = 3,
    links: Mapping[str, Link] | None = None,
    variants: Mapping[str, tuple[str, PipeMareConfig | None]] | None = None,
    rounds: dict[tuple[str, int, int], list[float]] | None = None,
) -> dict[tuple[str, int, int], dict[str, float]]:
    """:func:`step_times` of every ``(schedule, P, N)`` of ``configurations``, their windows
    taken in turn: the first window of each, then the second of each, and so on. ``schedule``
    may also name one of ``variants`` (e.g. :data:`~pipemare.experiments.studies.grid.VARIANTS`),
    which runs its schedule with its own corrections in place of ``config``
    (``pipemare-noWP``: the default without weight prediction).

    Each window runs ``warm + steps`` steps in this process with every action timed, replays
    the actions of the last ``steps`` through the schedule with each stage on a device of its
    own (:func:`pipemare.engine.telemetry.replay_timeline`; with a link, each microbatch's
    activations, the bytes of the last layer before each cut, and its gradients cross it) and
    divides the makespan by ``steps``; a configuration's time is the median of its ``repeats``
    windows, the same windows replayed for every link. Taken in turn, a drift of the machine's
    speed over the minutes the measurement lasts falls on every configuration alike (measured
    one after the other on this two-core machine, the same configuration moved 20-40% between
    two sittings ten minutes apart, and the ratios with it). Run it alone on the machine: the
    durations are measured. NaN for a configuration the pipeline refuses. ``rounds``, where
    given, receives each configuration's windows in the order taken, without links (round
    ``r`` of every configuration ran within the same minute: their ratio is that round's).
    """
    from pipemare.model.partition import layer_out_bytes

    x, y, _, _ = task.data()
    named: dict[str, Link | None] = {"free": None, **(links or {})}
    built: dict[tuple[str, int, int], tuple[Pipeline, list[float]]] = {}
    measured: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    sizes: dict[int, list[int]] = {}  # per microbatch's rows: each layer's output bytes
    for key in configurations:
        variant, stages, microbatches = key
        schedule, own = (variants or {}).get(variant, (variant, None))
        measured[key] = {name: [] for name in named}
        model = copy.deepcopy(_timed_model(task.name))
        try:
            pipe = _pipeline(task, model, schedule, stages, microbatches, 1e-4, own or config, 0)
        except ValueError:
            continue
        rows = task.batch // microbatches
        if rows not in sizes:
            sizes[rows] = layer_out_bytes(copy.deepcopy(_timed_model(task.name)), x[:rows])
        cuts = list(itertools.accumulate(pipe.balance))[:-1]
        built[key] = (pipe, [float(sizes[rows][c - 1]) for c in cuts])
    for _ in range(repeats):
        for key, (pipe, message) in built.items():
            spans = timed_window(pipe, task, x, y, warm, steps)
            for name, link in named.items():
                replay = None if link is None else Links([link] * len(message), message)
                _, makespan = replay_timeline(spans, key[1], replay)
                measured[key][name].append(makespan / steps)
    if rounds is not None:
        rounds.update({key: list(by_link["free"]) for key, by_link in measured.items()})
    return {
        key: {
            name: statistics.median(values) if values else math.nan
            for name, values in by_link.items()
        }
        for key, by_link in measured.items()
    }


def timed_window(
    pipe: Pipeline, task: Task, x: torch.Tensor, y: torch.Tensor, warm: int, steps: int
) -> list[Any]:
    """The spans of every action of ``steps`` steps of ``pipe`` after ``warm`` untimed ones,
    each step a batch of ``task.batch`` rows of ``(x, y)`` taken in order."""
    probe = Probe(timeline=True)
    pipe.probe = None
    for k in range(warm + steps):
        if k == warm:
            pipe.probe = probe
        idx = torch.arange(k * task.batch, (k + 1) * task.batch) % len(x)
        pipe.step((x[idx], y[idx]))
    return probe.take_spans()


def describe(result: RunResult) -> dict[str, Any]:
    return dataclasses.asdict(result)
