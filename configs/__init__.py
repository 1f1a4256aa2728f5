"""Experiment configs (YAML for ``pipemare fit --config``), installed as ``pipemare.configs``."""
