"""The Lightning glue: ``Trainer(strategy="pipemare")``, split by job: the strategy's hooks and
registration with both Lightning packages (strategy, packages), the launch's SIGTERM relay
(launching), setup checks (checks), building the pipeline from the run's plan and driving it
(runner), the user's step per microbatch (steps, manual), evaluation (evaluation) and
checkpoints (checkpoint, checkpoint_io).

The only folder that imports Lightning; it drives the engine and never the other way round. It
decides nothing itself: the run's plan comes from :func:`pipemare.planner.decide.decide`.
"""
