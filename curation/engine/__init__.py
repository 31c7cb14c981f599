"""The curation engine: plan, coordinator, ledger, weights, scoring workers, refresh runner.

Every module here is Ray-free and runs in-process in tests, except the package
:mod:`curation.engine.ray_backend`, which wraps them in Ray actors and hosts the data-parallel trainer's
worker group (the only code of the project that imports ray).
"""
