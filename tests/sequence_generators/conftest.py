"""Fixtures: the toy k-head checkpoints (see tests/models/khead_toy.py)."""

from tests.models.khead_toy import khead_k2, khead_k4, one_thread  # noqa: F401  (fixtures)
