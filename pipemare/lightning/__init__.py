"""The Lightning glue: ``Trainer(strategy="pipemare")``, split by job (launch and ranks, the
step adapter, log replay, checkpoint gathering and writing, registration).

The only folder that imports Lightning; it drives the engine and never the other way round.
"""
