"""Experiments shipped with pipemare: models, offline data, the engine demo and benchmarks."""
