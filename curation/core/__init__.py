"""The BLADE algorithm in torch and numpy: losses, selection, policies, refresh and its data, schedule, stream, loop.

Nothing here imports ray, composer or streaming; the trainer (``training/``) and the engine
(``curation/engine``) both call into it.
"""
