"""Registered on import of fairseq_fastgen."""
from fairseq_fastgen.tasks import translation_distill  # noqa: F401  (registration)
