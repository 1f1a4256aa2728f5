"""The Lightning glue: ``Trainer(strategy="pipemare")``, split by job: the strategy's hooks
(strategy), its processes and collectives (processes, launching), setup checks (checks),
building the pipeline (build), the steps (training, steps, module_adapter, logreplay), the
whole model's state and checkpoints (model_state, checkpointing, saving, checkpoint_io) and
registration with both Lightning packages (registry).

The only folder that imports Lightning; it drives the engine and never the other way round.
"""
