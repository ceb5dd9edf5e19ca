"""Decoders selectable with ``--decoder NAME``; importing this registers them all."""

from fairseq_fastgen.sequence_generators import beam, blockwise, greedy, var_beam  # noqa: F401  (registration)
from fairseq_fastgen.registry import DECODERS, decoder_names  # noqa: F401
