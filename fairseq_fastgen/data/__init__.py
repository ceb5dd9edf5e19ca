"""Data utilities for fairseq_fastgen (the embedded synthetic corpus lives in :mod:`.synthetic`)."""
