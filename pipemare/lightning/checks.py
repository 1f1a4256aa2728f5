"""The strategy's checks: its arguments, the run's precision, process layout, Trainer settings,
the split points and the optimiser, each refused before anything runs.

Every error says what to do instead.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from pipemare.engine.build import check_arguments
from pipemare.lightning.hooks import overrides
from pipemare.lightning.launching import START_METHODS
from pipemare.lightning.packages import LightningPackage
from pipemare.model.segments import DYNAMIC_SHAPES
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.settings import check_for_schedule, resolve

__all__ = [
    "check_hooks",
    "check_layout",
    "check_optimizer",
    "check_precision",
    "check_split_points",
    "check_step_in_optimizer_step",
    "check_strategy_arguments",
    "check_trainer",
    "ignore_moot_warnings",
    "one_optimizer",
]


#: what ``microbatch_weights`` may name
MICROBATCH_WEIGHTS = ("auto", "rows", "tokens")


def check_strategy_arguments(
    *,
    stages: Any,
    microbatches: Any,
    schedule: str,
    balance: Any,
    config: Any,
    sequential: Any,
    start_method: Any,
    module: Any = None,
    split_points: Any = None,
    dynamic_shapes: Any = "auto",
    timeout: Any,
    stall_timeout: Any,
    recompute: Any,
    heartbeat_timeout: Any = 30.0,
    compile: Any = False,
    microbatch_weights: Any = "auto",
) -> None:
    """Refuse a bad constructor argument of the strategy, naming what it takes instead: those
    it shares with the Pipeline by the engine's own check
    (:func:`~pipemare.engine.build.check_arguments`), then its own."""
    if isinstance(microbatches, str) and microbatches != "auto":
        raise ValueError(
            f"microbatches must be an integer >= 1 or 'auto' (N = P where the schedule never "
            f"flushes), got {microbatches!r}"
        )
    check_arguments(
        schedule=schedule,
        stages=stages,
        microbatches=1 if microbatches == "auto" else microbatches,
        balance=balance,
        recompute=recompute,
        compile=compile,
    )
    if config is not None and not isinstance(config, PipeMareConfig):
        raise TypeError(
            f"config must be a pipemare.PipeMareConfig, got {type(config).__name__}; "
            "e.g. PipeMareConfig(warmup_steps=20)"
        )
    if config is not None:  # refused here, before anything runs, not at the first batch
        check_for_schedule(config, schedule)
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}"
        )
    for key, value in (("module", module), ("sequential", sequential)):
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{key} must name the attribute to pipeline as a string, e.g. 'net' or "
                f"'model.transformer', got {value!r}"
            )
    if module is not None and sequential is not None and module != sequential:
        raise ValueError(
            f"module={module!r} and sequential={sequential!r} name two modules; sequential is "
            "the former name of module: pass module only"
        )
    if split_points is not None and (
        isinstance(split_points, str)
        or not isinstance(split_points, (list, tuple))
        or not all(isinstance(n, str) for n in split_points)
    ):
        raise ValueError(
            "split_points must be a list of module names, each a cut before that module, e.g. "
            f"['gpt.transformer.h.2', 'gpt.transformer.h.4'], got {split_points!r}"
        )
    if not callable(microbatch_weights) and microbatch_weights not in MICROBATCH_WEIGHTS:
        raise ValueError(
            "microbatch_weights must be 'auto' (by counted label tokens for a Hugging Face "
            "model, else by rows), 'rows', 'tokens' (labels other than -100 in the batch's "
            "'labels' or its last element) or a function of the microbatches returning their "
            f"shares, got {microbatch_weights!r}"
        )
    if dynamic_shapes not in DYNAMIC_SHAPES:
        raise ValueError(
            "dynamic_shapes must be 'auto' (the batch and the sequence length may vary) or "
            f"'all' (every input size, images' too), got {dynamic_shapes!r}"
        )
    if not isinstance(timeout, datetime.timedelta):
        raise ValueError(
            "timeout (for connecting the processes) must be a datetime.timedelta, e.g. "
            f"datetime.timedelta(minutes=30), got {timeout!r}"
        )
    _check_seconds("stall_timeout", stall_timeout, "")
    if heartbeat_timeout is not None:
        _check_seconds("heartbeat_timeout", heartbeat_timeout, " or None (no heartbeat)")


def _check_seconds(name: str, value: Any, alternative: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"{name} must be a positive, finite number of seconds{alternative}, got {value!r}"
        )


def check_layout(stages: int | None, devices: int, num_nodes: int) -> None:
    """Refuse a process count that cannot run whole copies of a ``stages``-stage pipeline."""
    world = devices * num_nodes
    if world > 1 and stages is not None and world % stages:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"PipeMareStrategy(stages={stages}) with devices={devices} and "
            f"num_nodes={num_nodes}: {world} processes cannot run whole copies of a "
            f"{stages}-stage pipeline; use stages={' or '.join(map(str, fits))} "
            f"(devices*num_nodes/stages copies, each a pipeline), change the device count, "
            f"or devices=1 to simulate the {stages} stages in one process"
        )


def check_precision(package: LightningPackage, plugin: Any) -> None:
    """Refuse a precision other than 32-bit, bf16-mixed or bf16-true (``plugin`` from the
    strategy's Lightning ``package``)."""
    name = getattr(plugin, "precision", "32-true")
    ok = (
        (type(plugin) is package.precision)
        or (isinstance(plugin, package.mixed_precision) and name == "bf16-mixed")
        or (isinstance(plugin, package.half_precision) and name == "bf16-true")
    )
    if not ok:
        raise ValueError(
            f"pipemare supports precision '32-true', 'bf16-mixed' and 'bf16-true', not "
            f"{name!r} ({type(plugin).__name__}); float16 needs loss scaling across stages, which "
            "pipemare does not do: use precision='bf16-mixed'"
        )


def check_trainer(module: Any, trainer: Any) -> None:
    """Refuse gradient accumulation and a bad clipping threshold (under manual optimisation
    Lightning refuses both itself)."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: a pipeline already "
            "accumulates over its microbatches; use PipeMareStrategy(microbatches=N) instead"
        )
    clip = trainer.gradient_clip_val
    if clip is not None and not (isinstance(clip, (int, float)) and 0 <= clip < math.inf):
        raise ValueError(
            f"gradient_clip_val={clip!r}: a clipping threshold must be a positive number; "
            "pass one, or 0 or None for no clipping"
        )


#: LightningModule methods a pipeline never calls as Lightning would, with what to do instead
_UNHONOURED = {
    "backward": (
        "pipemare runs each microbatch's backward pass itself, stage by stage, so Lightning "
        "never calls it. Remove the override; to read or change the gradients use "
        "on_after_backward or on_before_optimizer_step, to clip them "
        "configure_gradient_clipping"
    ),
    "manual_backward": (
        "pipemare takes the loss passed to self.manual_backward and runs its backward pass "
        "itself, per microbatch and stage, so the override would never run. Remove it; to "
        "scale the loss, scale it before passing it"
    ),
    "optimizer_zero_grad": (
        "pipemare zeroes each stage's gradients itself, right after that stage's update (they "
        "accumulate over the minibatch's microbatches, and in a non-flushing schedule across "
        "steps), so the override could not decide when gradients are zeroed. Remove it; to "
        "accumulate over more samples, raise PipeMareStrategy(microbatches=N) or the batch size"
    ),
}


def check_hooks(module: Any) -> None:
    """Refuse, at setup of fit, a LightningModule method the module overrides that a pipeline
    cannot honour (:mod:`pipemare.lightning.hooks` fires the gradient hooks it can)."""
    for name, why in _UNHONOURED.items():
        if name == "manual_backward" and module.automatic_optimization:
            continue  # Lightning calls it only under manual optimisation
        if overrides(module, name):
            raise ValueError(f"{type(module).__name__} overrides {name}, but {why}")


def check_step_in_optimizer_step(module: Any, stepping: bool) -> None:
    """Refuse, before the step's updates, a training step run outside ``optimizer.step``
    (``stepping`` False): an ``optimizer_step`` override that calls the closure itself would
    expect to skip or defer the update, and the pipeline applies it inside the closure."""
    if stepping or not module.automatic_optimization:
        return
    raise ValueError(
        f"{type(module).__name__}.optimizer_step ran training_step by calling the closure "
        "itself, not through optimizer.step(closure=optimizer_closure); pipemare applies the "
        "stages' updates inside the closure, so the override cannot skip or defer them. Call "
        "optimizer.step(closure=optimizer_closure) once in it (code before and after that "
        "call runs as on one device, e.g. a learning-rate warm-up), or remove the override"
    )


@contextlib.contextmanager
def one_optimizer() -> Iterator[None]:
    """Around Lightning's setup: its refusal of several optimisers, in pipemare's words."""
    try:
        yield
    except RuntimeError as err:  # Lightning's words would send the user to manual optimization
        if "multiple optimizers" not in str(err) or "optimizer_idx" in str(err):
            raise
        raise ValueError(
            "pipemare steps one optimiser, stage by stage; configure_optimizers returned "
            "several, which Lightning runs only under manual optimisation. Return one "
            "optimiser, with a parameter group for each part that needs other settings, e.g. "
            "torch.optim.Adam([{'params': body.parameters()}, {'params': head.parameters(), "
            "'lr': 1e-4}]), or pipemare.optim.MuonAdamW(muon_param_groups(model)) for Muon on "
            "the weight matrices and AdamW on the rest; or set self.automatic_optimization = "
            "False and step both in training_step (pipemare steps them together)"
        ) from err


def check_optimizer(
    optimizer: Any, schedule: str, stages: int, microbatches: int, config: PipeMareConfig | None
) -> None:
    """Refuse, before any update, an optimiser the pipeline cannot step (LBFGS) or that a
    correction set to True cannot serve: the checks the pipeline makes when it is built
    (:func:`~pipemare.optim.settings.resolve`, for a stand-in run length)."""
    from pipemare.optim.optimizer import PipeMareOptimizer

    with warnings.catch_warnings():  # what the run resolves is printed when it is built
        warnings.simplefilter("ignore")
        settings = resolve(
            config,
            optimizer,
            schedule=schedule,
            stages=stages,
            microbatches=microbatches,
            total_steps=1,
            steps_per_epoch=1,
        )
        PipeMareOptimizer(optimizer, {}, settings.delays, settings=settings)


def ignore_moot_warnings() -> None:
    """Silence the warnings that are wrong about a pipelined run, by their exact text:

    - torch's "``lr_scheduler.step()`` before ``optimizer.step()``": the pipeline steps the
      optimiser per stage, and before its first update a non-flushing pipeline is still
      filling, which torch reads as a wrong call order;
    - Lightning's advice to log epoch metrics with ``sync_dist=True`` on several processes:
      the last stage publishes every metric to every process (:mod:`pipemare.engine.lagged`),
      so they are already the same everywhere.
    """
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
    warnings.filterwarnings(
        "ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`"
    )


def check_split_points(adapter: Any, split_points: Sequence[str] | None) -> None:
    """Refuse split points that name no module of the pipelined one, or that a Sequential (cut
    by ``balance``) would ignore."""
    if split_points is None:
        return
    if not adapter.segmented:
        raise ValueError(
            f"{adapter.what} is an nn.Sequential, which is cut between its children by "
            "balance=[layers per stage]; split_points cut other modules. Pass balance instead"
        )
    names = dict(adapter.pipelined.named_modules())
    for name in adapter.split_points:
        if name not in names:
            near = [n for n in names if n and n.split(".")[-1] == name.split(".")[-1]][:3]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(
                f"split point {name!r} names no module of {adapter.what}{hint}; name the "
                f"modules to cut before, e.g. {adapter.path}.transformer.h.2"
            )


def check_state_keys(module: Any, state: Any) -> None:
    """Refuse, as ``load_state_dict(strict=True)`` would, a checkpoint whose names are not the
    module's (checked without reading any tensor)."""
    own = list(module.state_dict(keep_vars=True))
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in set(own)]
    if missing or unexpected:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing key(s) "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''}, unexpected key(s) "
            f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}; the checkpoint was saved "
            "from another model (or pass strict=False to load what matches)"
        )
