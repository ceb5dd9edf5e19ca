"""Registered on import of fairseq_fastgen."""
from fairseq_fastgen.models import transformer_khead  # noqa: F401  (registration)
