"""The experiments' tests train the same tiny demo runs as the training tests: their fixtures, shared."""

from tests.training.conftest import demo_root, make_config  # noqa: F401  (fixtures, found by name)
