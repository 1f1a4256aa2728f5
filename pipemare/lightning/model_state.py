"""The strategy's hooks that need the whole model while its stages live in several processes:
draining, consolidating after a run, tearing down after an error, and checkpoints.

A checkpoint is one ordinary Lightning checkpoint with the whole model. Lightning asks the
strategy for the model's and the optimiser's state, then hands the dict to ``save_checkpoint``;
during training both are collected without draining and the file is written once every stage
has its part (:mod:`~pipemare.lightning.saving`). Loading restores the user's optimiser state
at once and pipemare's own part (corrections, step count, random streams;
:mod:`~pipemare.lightning.checkpointing`) into the pipeline once it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipemare.engine.pipeline import Pipeline
from pipemare.lightning import checkpointing
from pipemare.lightning.launching import LightningAPI, StrategyBase
from pipemare.lightning.module_adapter import ModuleAdapter
from pipemare.lightning.saving import SaveQueue
from pipemare.lightning.training import TrainingReports

__all__ = ["ModelStateHooks"]


class ModelStateHooks(StrategyBase):
    """Lightning's hooks for a model whose stages may live in other processes."""

    pipeline: Pipeline | None
    _adapter: ModuleAdapter | None
    _saves: SaveQueue  # built with _write_file and _remove_file
    _pending_state: dict[str, Any] | None  # pipemare's part of a checkpoint, to load
    _trained: dict[str, Any] | None  # the layout of the run that wrote the loaded checkpoint
    _reports: TrainingReports
    _lightning: LightningAPI
    if TYPE_CHECKING:

        @property
        def distributed(self) -> bool: ...  # ProcessesMixin's

    def _drain(self) -> None:
        """Finish every minibatch in flight: each stage's state is then final."""
        if self.pipeline is not None:
            self.pipeline.drain()
            self.pipeline.sync_buffers()  # the copies evaluate (and save) copy 0's buffers
            self._write_due()

    def _consolidate(self) -> None:
        """Give every process the whole model again (as DDP leaves it): each held one stage."""
        self._drain()
        if self.distributed and self.pipeline is not None:
            assert self.lightning_module is not None
            module, device = self.lightning_module, self.root_device
            checkpointing.consolidate(module, self.pipeline, self._state_names, device)
            self.pipeline = None  # its stages are no longer split; the next run rebuilds it

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Only after an error: a run ends by consolidating. Moving meta stages to the CPU
            # would raise and hide the original error, so skip that step of the teardown.
            for part in (
                self.cluster_environment,
                self.precision_plugin,
                self.accelerator,
                self.checkpoint_io,
            ):
                if part is not None:
                    part.teardown()
            return
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def _state_names(self) -> checkpointing.StateNames:
        """A stage module's state-dict key -> the LightningModule's own key for it."""
        assert self._adapter is not None
        return self._adapter.state_key

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model; during training the state each stage has once the step's
        minibatch has reached it, collected without draining (:mod:`~pipemare.lightning.saving`)."""
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        if self.pipeline is None:
            return module.state_dict()
        return self._saves.module_state(module, self.pipeline, self._state_names)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The user's optimiser state for the whole model, plus pipemare's own under "pipemare"."""
        if self.pipeline is None:
            return optimizer.state_dict()
        return self._saves.optimizer_state(optimizer, self.pipeline)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        self._saves.save(checkpoint, filepath, storage_options, self.pipeline)
        self._write_due()

    def remove_checkpoint(self, filepath: Any) -> None:
        self._saves.remove(filepath)

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, options: Any) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=options)

    def _remove_file(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)

    def _write_due(self) -> None:
        """Write the queued checkpoints whose step reached every stage by now."""
        if self._adapter is not None:
            assert self.lightning_module is not None
            self._saves.poll(self.lightning_module, self.pipeline, self._state_names)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's, noting how the checkpoint's run was laid out and corrected, which
        validate, test and predict report (they restore no optimiser state)."""
        self._trained = checkpointing.trained_layout(checkpoint)
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        pending = checkpointing.load_optimizer_states(self.optimizers, states)
        if pending is not None:
            self._pending_state = pending
        if self.pipeline is not None and self._pending_state is not None:
            self._load_pending_state()
            results = self._reports.results
            if results is not None:  # the next minibatch to report moved with it
                results.start = results.next = self.pipeline.minibatches_fed

    def _load_pending_state(self) -> None:
        """Load pipemare's part of a checkpoint into the pipeline, once both exist."""
        if self._pending_state is None:
            return
        assert self.pipeline is not None
        notes, run_notes = checkpointing.load_pipemare_state(self.pipeline, self._pending_state)
        self._pending_state = None
        checkpointing.warn_layout_changes(notes, self._lightning.rank_zero_warn)
        checkpointing.warn_run_changes(run_notes, self._lightning.rank_zero_warn)
