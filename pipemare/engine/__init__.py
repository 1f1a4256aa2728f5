"""Everything that runs a pipeline: stages (with the no-stash saved tensors, recomputation, their
random streams and memory), the executor that interprets a schedule, the transports between
stages, lagged results, snapshots, the watchdog, replicas and telemetry.

:class:`~pipemare.engine.pipeline.Pipeline` is its face. No module here imports Lightning.
"""
