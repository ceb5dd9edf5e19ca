"""Registered on import of fairseq_fastgen."""
from fairseq_fastgen.criterions import random_subloss  # noqa: F401  (registration)
