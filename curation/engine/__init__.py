"""The curation engine: plan, coordinator, ledger, weights, scoring workers, refresh runner.

Every module here is Ray-free and runs in-process in tests, except :mod:`curation.engine.ray_backend`,
which wraps them in Ray actors (the only module of the project that imports ray).
"""
