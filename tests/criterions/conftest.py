"""Fixtures shared with the model tests (see tests/models/khead_toy.py)."""

from tests.models.khead_toy import one_thread  # noqa: F401  (fixture)
