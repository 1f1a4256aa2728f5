"""PipelineMonitor: throughput, per-stage busy/communication/idle time, utilisation, a timeline."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from pipemare.callbacks import _common as common
from pipemare.callbacks import wandb as wandb_extras
from pipemare.engine.microbatch import batch_size
from pipemare.engine.telemetry import Span, replay_timeline, summarize_spans


class PipelineMonitor(common.Monitor):
    """Logs how well the pipeline keeps its stages busy.

    ``pipemare/throughput`` (training samples/s), ``pipemare/utilization`` (mean over stages),
    ``pipemare/pipeline_time`` (seconds of training so far on P devices) and per stage
    ``pipemare/stage{i}/{compute_s, comm_s, idle_s, utilization}``. With one process per stage
    these are measured; in one process (simulated stages run one after the other) they come
    from replaying the recorded actions with their measured durations as if each stage had its
    own device, and the metrics say so (``pipemare/simulated = 1``): there the pipeline time is
    the replayed time per step of the sampled steps times the steps run, while the process's
    own (serial) wall time is ``pipemare/wall_time`` of the ``ConvergenceMonitor``.

    It also puts the pipeline's configuration in every logger's hyperparameters and, with a
    ``WandbLogger``, defines the metrics' step axis and logs a per-stage table.

    Args:
        log_every_n_steps: logging interval (default: the Trainer's).
        trace_path: if set, write a Chrome-trace / Perfetto JSON timeline of the training steps
            in ``trace_steps`` there: one track per stage with its forwards, backwards,
            updates, sends and receives (``chrome://tracing`` or https://ui.perfetto.dev).
        trace_steps: ``[first, last)`` training steps of the timeline (after the pipeline filled).
        timeline_every_n_steps: utilisation is measured on every n-th training step (recording
            every action of a step costs about a microsecond each; 1 records all steps).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        trace_path: str | Path | None = None,
        trace_steps: tuple[int, int] = (5, 10),
        timeline_every_n_steps: int = 10,
    ) -> None:
        if timeline_every_n_steps < 1:
            raise ValueError(f"timeline_every_n_steps must be >= 1, got {timeline_every_n_steps}")
        super().__init__(log_every_n_steps)
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self.trace_steps = trace_steps
        self.timeline_every_n_steps = timeline_every_n_steps
        self._spans: list[Span] = []
        self._trace: list[Span] = []
        self._samples = 0
        self._window_start: float | None = None
        self._sampled_wall, self._step_start = 0.0, 0.0
        self._sampled_steps, self._window_steps = 0, 0
        self._pipeline_time, self._step_time = 0.0, 0.0
        self._config_logged = False

    @property
    def pipeline_time(self) -> float:
        """Seconds of training so far on P devices: as last logged, plus the steps since then
        at the last measured time per step (simulated stages; measured with a process per stage
        it is the last logged value)."""
        return self._pipeline_time + self._step_time * self._window_steps

    def _watch(self, trainer: pl.Trainer, strategy: common.PipelinedStrategy) -> None:
        strategy.request_probe(timeline=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wandb_extras.define_metrics(trainer)

    def _tracing(self, step: int) -> bool:
        first, last = self.trace_steps
        return self.trace_path is not None and first <= step < last

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start = now
        self._step_start = now
        watched = common.probed(trainer)
        if watched is not None:  # record this step's actions or not
            step = trainer.global_step
            watched[1].timeline = step % self.timeline_every_n_steps == 0 or self._tracing(step)

    def _after_batch(
        self, trainer: pl.Trainer, outputs: Any, batch: Any, watched: common.Watched
    ) -> None:
        self._samples += batch_size(batch)
        self._window_steps += 1
        if watched is None:
            return
        pipe, probe = watched
        if not self._config_logged:
            common.log_config(trainer)
            self._config_logged = True
        step = trainer.global_step - 1  # the step that just ran
        if probe.timeline:
            spans = probe.take_spans()
            if step % self.timeline_every_n_steps == 0:
                self._spans += spans
                self._sampled_wall += time.perf_counter() - self._step_start
                self._sampled_steps += 1
            if self._tracing(step):
                self._trace += spans
                if step == self.trace_steps[1] - 1:
                    self._write_trace(trainer, pipe.num_stages)
        if self._due(trainer):
            self._log(trainer, pipe.num_stages)

    def _log(self, trainer: pl.Trainer, num_stages: int) -> None:
        assert self._window_start is not None
        wall = time.perf_counter() - self._window_start
        simulated = self._strategy is None or not self._strategy.distributed
        if simulated:
            replayed, makespan = replay_timeline(self._spans, num_stages)
            stats = summarize_spans(replayed, makespan)
            if self._sampled_steps:  # else the last sampled steps' time per step holds
                self._step_time = makespan / self._sampled_steps
            self._pipeline_time += self._step_time * self._window_steps
        else:
            self._pipeline_time += wall
            stats = common.gather_stages(trainer, summarize_spans(self._spans, self._sampled_wall))
        stats = {
            i: {k + ("_s" if k != "utilization" else ""): v for k, v in s.items()}
            for i, s in stats.items()
        }
        metrics = {f"{common.PREFIX}/throughput": self._samples / wall if wall > 0 else 0.0}
        if stats:
            metrics[f"{common.PREFIX}/utilization"] = sum(
                s["utilization"] for s in stats.values()
            ) / len(stats)
        metrics[f"{common.PREFIX}/pipeline_time"] = self._pipeline_time
        metrics[f"{common.PREFIX}/simulated"] = float(simulated)
        self._log_stages(trainer, stats, metrics)
        self._spans, self._samples, self._window_start = [], 0, time.perf_counter()
        self._sampled_wall, self._sampled_steps, self._window_steps = 0.0, 0, 0

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            wandb_extras.log_stage_table(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wandb_extras.log_stage_table(trainer)

    def _write_trace(self, trainer: pl.Trainer, num_stages: int) -> None:
        simulated = self._strategy is None or not self._strategy.distributed
        if simulated:
            spans, _ = replay_timeline(self._trace, num_stages)
        else:
            spans = [s for part in common.gather(trainer, self._trace) for s in part]
        self._trace = []
        if trainer.global_rank != 0:
            return
        assert self.trace_path is not None
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self.trace_path.write_text(json.dumps(chrome_trace(spans, num_stages, simulated)))


_LABELS = {"F": "forward", "B": "backward", "U": "update", "recv": "recv", "send": "send"}


def chrome_trace(spans: list[Span], num_stages: int, simulated: bool) -> dict[str, Any]:
    """Spans as Chrome trace events: one thread (track) per stage, times in microseconds."""
    origin = min((s[3] for s in spans), default=0.0)
    process = "pipemare (replayed from one process)" if simulated else "pipemare"
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": process}}
    ]
    for i in range(num_stages):
        events.append(
            {"ph": "M", "pid": 0, "tid": i, "name": "thread_name", "args": {"name": f"stage {i}"}}
        )
        events.append(
            {"ph": "M", "pid": 0, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}}
        )
    for stage, name, index, start, end in spans:
        kind = "minibatch" if name == "U" else "microbatch"
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": stage,
                "cat": _LABELS.get(name, name),
                "name": f"{name}{index}" if name in ("F", "B", "U") else f"{name} {index}",
                "ts": (start - origin) * 1e6,
                "dur": max(end - start, 0.0) * 1e6,
                "args": {kind: index},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"simulated": simulated}}
