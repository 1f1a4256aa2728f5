"""The Lightning glue: ``Trainer(strategy="pipemare")``, split by job: the strategy's hooks and
registration with both Lightning packages (strategy), Lightning's symbols and signals
(launching), setup checks (checks), building and driving the pipeline (runner), the steps
(training, steps, module_adapter, manual, logreplay) and checkpoints (checkpoint,
checkpoint_io).

The only folder that imports Lightning; it drives the engine and never the other way round.
"""
