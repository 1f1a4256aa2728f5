"""Where the strategy's process sits: its device and rank, the stages and copies of the
pipeline the processes form, the collectives Lightning calls, and starting the processes.

Lightning reads these as properties and methods of the strategy, so they are a mixin of it;
the launch itself is :mod:`~pipemare.lightning.launching`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine.layout import RankLayout
from pipemare.lightning import checks, launching
from pipemare.lightning.launching import LightningAPI, StrategyBase

__all__ = ["ProcessesMixin"]


class ProcessesMixin(StrategyBase):
    """Devices, ranks, the pipeline's stages and copies over the processes, collectives."""

    stages: int | None
    _num_nodes: int
    _start_method: str
    _timeout: datetime.timedelta
    _lightning: LightningAPI

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed(self) -> bool:
        """One stage per process (else every stage runs in this process)."""
        return self.num_processes * self.num_nodes > 1

    @property
    def is_distributed(self) -> bool:  # Lightning reads it for sync_dist and samplers
        return self.distributed

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # every stage of a copy of the pipeline sees the same batches; the copies split them
        if not self.distributed:
            return {"num_replicas": 1, "rank": 0}
        layout = self.rank_layout
        return {"num_replicas": layout.replicas, "rank": layout.position(self.global_rank)[0]}

    @property
    def num_stages(self) -> int | None:
        if self.distributed:
            return self.stages if self.stages is not None else self._world_size
        return self.stages if self.stages is not None else None

    @property
    def _world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @property
    def rank_layout(self) -> RankLayout:
        """Which processes form each copy of the pipeline and which hold each stage's replicas
        (:class:`~pipemare.engine.layout.RankLayout`): ``devices * num_nodes / stages`` copies."""
        stages = self.num_stages if self.distributed else 1
        assert stages is not None
        return RankLayout(self._world_size, stages, max(self.num_processes, 1))

    @property
    def replicas(self) -> int:
        """D: data-parallel copies of the pipeline (1 unless ``stages`` < the process count)."""
        return self.rank_layout.replicas if self.distributed else 1

    # -- launch -------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        checks.check_layout(self.stages, self.num_processes, self.num_nodes)
        checks.check_precision(self._lightning, self.precision_plugin)
        self._launcher = launching.make_launcher(self, self._start_method)

    def set_world_ranks(self) -> None:
        launching.set_world_ranks(self)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.distributed:
            launching.connect(self, self._timeout)

    # -- collectives (identity in one process) ----------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (self.distributed and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self.distributed:
            return self._lightning.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
