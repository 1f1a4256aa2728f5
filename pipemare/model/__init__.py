"""A model cut into stages: which layers each stage holds, what crosses a cut.

Depends on torch alone; the engine, the planner and the Lightning strategy cut models
through it.
"""
