"""``--decoder beam``: fairseq's own SequenceGenerator, unchanged (the default)."""

from fairseq_fastgen.registry import register_builder

register_builder("beam", None, guarantee="stock fairseq beam search (default)")
