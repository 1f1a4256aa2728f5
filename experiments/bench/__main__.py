"""``python -m pipemare.experiments.bench``: the benchmark (torchrun starts its workers so)."""

from pipemare.experiments.bench.command import main

main()
