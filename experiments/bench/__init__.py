"""Benchmarks: throughput and memory against one process and torch's pipelines, engine overhead."""

from pipemare.experiments.bench.command import decompose, main, run_benchmarks, table
from pipemare.experiments.bench.memory import memory_study, mlp, saved_bytes

__all__ = ["decompose", "main", "memory_study", "mlp", "run_benchmarks", "saved_bytes", "table"]
