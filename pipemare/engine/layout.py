"""Which ranks form a pipeline and which hold the replicas of one stage (D × P processes).

With world size ``W = P · D`` the ranks run ``D`` data-parallel copies of a ``P``-stage
pipeline. Pipeline ``r`` is the ``P`` consecutive ranks ``r·P … r·P + P − 1``; stage ``i``'s
replicas are ranks ``i, P + i, 2P + i, …``. Launchers number ranks node by node
(``node_rank · devices + local_rank``), so when ``P`` divides the devices per node every
pipeline lies inside one node — its activations and gradients, sent at every microbatch,
stay on the fast links — and only the gradient all-reduce of each stage's replicas, once per
update, crosses nodes (the layout DAPPLE and PipeDream's replicated stages use).
"""

from __future__ import annotations

import dataclasses

from pipemare.lines import text

__all__ = ["RankLayout", "divisors"]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """The rank layout of ``replicas`` copies of a ``stages``-stage pipeline.

    Args:
        world_size: the number of processes, ``stages · replicas``.
        stages: P.
        devices_per_node: processes per node (for where the pipelines lie).

    Example:
        >>> layout = RankLayout(world_size=4, stages=2, devices_per_node=2)
        >>> layout.pipelines, layout.stage_groups
        (((0, 1), (2, 3)), ((0, 2), (1, 3)))
        >>> layout.position(3)
        (1, 1)
    """

    world_size: int
    stages: int
    devices_per_node: int

    def __post_init__(self) -> None:
        for name in ("world_size", "stages", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.world_size % self.stages:
            raise ValueError(
                f"{self.world_size} processes cannot run whole copies of a {self.stages}-stage "
                f"pipeline; use a stage count that divides it (e.g. "
                f"{', '.join(str(d) for d in divisors(self.world_size))}) or change devices"
            )

    @property
    def replicas(self) -> int:
        """D: data-parallel copies of the pipeline."""
        return self.world_size // self.stages

    @property
    def pipelines(self) -> tuple[tuple[int, ...], ...]:
        """Per replica, its ranks in stage order."""
        p = self.stages
        return tuple(tuple(range(r * p, (r + 1) * p)) for r in range(self.replicas))

    @property
    def stage_groups(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the ranks holding its replicas (they all-reduce gradients)."""
        p = self.stages
        return tuple(tuple(range(i, self.world_size, p)) for i in range(p))

    def position(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return divmod(rank, self.stages)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    @property
    def pipelines_cross_nodes(self) -> bool:
        """Whether some pipeline spans two nodes (its point-to-point traffic crosses them)."""
        return any(len({self.node(r) for r in ranks}) > 1 for ranks in self.pipelines)

    def describe(self) -> str:
        """A table for the run's log: one line per pipeline, its ranks and nodes."""
        lines = [
            text(
                "processes",
                replicas=self.replicas,
                stages=self.stages,
                processes=self.world_size,
            )
        ]
        for r, ranks in enumerate(self.pipelines):
            nodes = sorted({self.node(k) for k in ranks})
            where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes}"
            last = self.stages - 1
            lines.append(f"  pipeline {r}: ranks {list(ranks)} (stage 0 .. {last}), {where}")
        if self.replicas > 1:
            groups = ", ".join(f"stage {i}: {list(g)}" for i, g in enumerate(self.stage_groups))
            lines.append(f"  gradient all-reduce groups: {groups}")
        if self.pipelines_cross_nodes:
            lines.append(
                f"  note: pipelines span nodes ({self.stages} stages, {self.devices_per_node} "
                "devices per node); a stage count dividing the devices per node keeps each "
                "pipeline's traffic inside a node"
            )
        return "\n".join(lines)


def divisors(n: int) -> tuple[int, ...]:
    """Every whole number that divides ``n``: the copies a world of ``n`` processes can run,
    or the N that split a batch of ``n`` rows into equal microbatches.

    Example:
        >>> divisors(12)
        (1, 2, 3, 4, 6, 12)
    """
    return tuple(d for d in range(1, n + 1) if n % d == 0)
