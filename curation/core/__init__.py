"""The BLADE algorithm, pure torch and numpy: losses, selection, policies, refresh, schedule, stream, loop.

Nothing here imports ray, composer or a file format; the trainer (``training/``) and the engine
(``curation/engine``) both call into it.
"""
