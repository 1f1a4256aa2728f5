"""ConvergenceMonitor: per-stage gradient norms, time to a target metric, divergence detection."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn

from pipemare.callbacks import _common as common
from pipemare.lines import text

_ON_DIVERGENCE = ("raise", "stop", "warn")


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where and when training diverged."""

    step: int
    stage: int
    loss: float
    reason: str

    def message(self) -> str:
        """The one line a divergence is reported with: step, stage, reason and loss."""
        return text(
            "diverged", step=self.step, stage=self.stage, reason=self.reason, loss=self.loss
        )


class DivergenceError(RuntimeError):
    """Training diverged; raised by :class:`ConvergenceMonitor` on every rank at the same step."""

    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence
        super().__init__(divergence.message())


class ConvergenceMonitor(common.Monitor):
    """Watches convergence and stops a run that diverged.

    Logs ``pipemare/stage{i}/grad_norm`` (gradient norm of each stage's update, before clipping),
    ``pipemare/wall_time`` (seconds since fit started, an x-axis for loss curves) and, once the
    target is reached, ``pipemare/steps_to_target`` and ``pipemare/time_to_target``. Train and
    validation losses and task metrics (torchmetrics accuracy, perplexity) are the module's own
    ``self.log`` calls.

    Divergence is a non-finite training loss or one above ``blowup`` times the best smoothed
    loss so far (after ``warmup_steps``). Training then ends on every rank (see
    ``on_divergence``), with a message that names the step and the stage: the first stage
    whose forward output held NaN/Inf, or else the stage whose gradient norm grew the most.

    Args:
        target: ``(metric, value, mode)``, e.g. ``("val_acc", 0.95, "max")``.
        blowup: factor over the best smoothed loss that counts as divergence.
        warmup_steps: steps before the blow-up test starts (non-finite losses count at once).
        log_every_n_steps: logging interval (default: the Trainer's).
        on_divergence: ``"raise"`` (default): raise :class:`DivergenceError` on every rank at
            the same step, so every process exits non-zero; ``"stop"``: stop as Lightning's
            ``EarlyStopping`` does (exit 0, e.g. for a study that records diverged runs);
            ``"warn"``: warn, record, train on.
    """

    def __init__(
        self,
        target: tuple[str, float, str] | None = None,
        blowup: float = 10.0,
        warmup_steps: int = 20,
        log_every_n_steps: int | None = None,
        on_divergence: str = "raise",
    ) -> None:
        if target is not None and target[2] not in ("min", "max"):
            raise ValueError(f"target mode must be 'min' or 'max', got {target[2]!r}")
        if blowup <= 1:
            raise ValueError(f"blowup must be > 1, got {blowup}")
        self.target, self.blowup, self.warmup_steps = target, blowup, warmup_steps
        if on_divergence not in _ON_DIVERGENCE:
            raise ValueError(
                f"on_divergence must be one of {', '.join(_ON_DIVERGENCE)}, got {on_divergence!r}"
            )
        super().__init__(log_every_n_steps)
        self.on_divergence = on_divergence
        self.divergence: Divergence | None = None
        self.steps_to_target: int | None = None
        self.time_to_target: float | None = None
        self._best: float | None = None
        self._smoothed: float | None = None
        self._start = 0.0
        # per stage: (sum of the earlier gradient norms, how many, the latest), O(1) however
        # long the run
        self._grad: dict[int, tuple[float, int, float]] = {}

    def _watch(self, trainer: pl.Trainer, strategy: common.PipelinedStrategy) -> None:
        strategy.delegate_divergence()  # its diagnosis replaces the bare check
        strategy.request_probe(grad_norm_every=common.interval(trainer, self.log_every_n_steps))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def _after_batch(
        self, trainer: pl.Trainer, outputs: Any, batch: Any, watched: common.Watched
    ) -> None:
        if watched is not None:
            for (i, _), norm in sorted(watched[1].take_grad_norms().items()):
                earlier, count, latest = self._grad.get(i, (0.0, -1, 0.0))
                self._grad[i] = (earlier + latest, count + 1, norm)
        loss = _loss(outputs)
        if loss is not None and self.divergence is None:
            reason = self._diverged(loss, trainer.global_step)
            if reason is not None:
                self._on_divergence(trainer, loss, reason)
                return
        if self._due(trainer):
            self._log(trainer)

    def _diverged(self, loss: float, step: int) -> str | None:
        if not math.isfinite(loss):
            return "the loss is not finite"
        self._smoothed = loss if self._smoothed is None else 0.9 * self._smoothed + 0.1 * loss
        self._best = self._smoothed if self._best is None else min(self._best, self._smoothed)
        if step >= self.warmup_steps and self._best > 0 and loss > self.blowup * self._best:
            return f"the loss blew up to {loss / self._best:.1f}x its best smoothed value"
        return None

    def _log(self, trainer: pl.Trainer) -> None:
        local = {i: {"grad_norm": latest} for i, (_, _, latest) in self._grad.items()}
        stats = common.gather_stages(trainer, local)
        wall_time = {f"{common.PREFIX}/wall_time": time.perf_counter() - self._start}
        self._log_stages(trainer, stats, wall_time)

    def _on_divergence(self, trainer: pl.Trainer, loss: float, reason: str) -> None:
        pipe = common.pipeline(trainer)
        watched = common.probed(trainer)
        local_bad = watched[1].first_nonfinite() if watched is not None else {}
        local_growth = {
            i: latest / (earlier / count)
            for i, (earlier, count, latest) in self._grad.items()
            if count > 0 and earlier > 0
        }
        parts = common.gather(trainer, (local_bad, local_growth))  # every rank reaches this step
        bad = {i: m for b, _ in parts for i, m in b.items()}
        growth = {i: g for _, gr in parts for i, g in gr.items()}
        if bad:
            first = min(bad.values())
            stage = min(i for i, m in bad.items() if m == first)
            reason += f"; stage {stage} was the first to output NaN/Inf (microbatch {first})"
        elif growth:
            stage = max(growth, key=lambda i: growth[i])
            reason += (
                f"; stage {stage}'s gradient norm grew the most ({growth[stage]:.1f}x its mean)"
            )
        else:
            stage = pipe.num_stages - 1 if pipe is not None else 0
            reason += "; the loss is computed on the last stage"
        # the step whose minibatch gave the loss: a non-flushing pipeline reports it lagged
        strategy = common.strategy_of(trainer)
        step = (strategy.reported_step if strategy is not None else None) or trainer.global_step
        self.divergence = Divergence(step, stage, loss, reason)
        rank_zero_warn(self.divergence.message())
        common.log(
            trainer,
            {f"{common.PREFIX}/diverged": 1.0, f"{common.PREFIX}/diverged_stage": float(stage)},
        )
        if self.on_divergence == "stop":
            trainer.should_stop = True
        elif self.on_divergence == "raise":
            raise DivergenceError(self.divergence)  # every rank: the loss is the same everywhere

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.target is None or trainer.sanity_checking or self.steps_to_target is not None:
            return
        name, value, mode = self.target
        current = trainer.callback_metrics.get(name)
        if current is None:
            return
        reached = float(current) >= value if mode == "max" else float(current) <= value
        if reached:
            self.steps_to_target = trainer.global_step
            self.time_to_target = time.perf_counter() - self._start
            common.log(
                trainer,
                {
                    f"{common.PREFIX}/steps_to_target": float(self.steps_to_target),
                    f"{common.PREFIX}/time_to_target": self.time_to_target,
                },
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_to_target": self.steps_to_target,
            "best": self._best,
            "smoothed": self._smoothed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_to_target = state_dict.get("steps_to_target")
        self._best, self._smoothed = state_dict.get("best"), state_dict.get("smoothed")


def _loss(outputs: Any) -> float | None:
    value: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
