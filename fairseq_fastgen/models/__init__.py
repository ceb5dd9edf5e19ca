"""Registered on import of fairseq_fastgen."""
