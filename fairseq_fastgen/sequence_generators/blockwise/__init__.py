"""Blockwise parallel decoding (``--decoder blockwise``, ``blockwise-stream``), read in this order:

* ``options.py``: the options and the acceptance criteria (is a proposed token good enough?);
* ``policy.py``: predict / verify / accept, the batched ``advance`` (its docstring: the algorithm);
* ``one_row.py``: the same ``advance`` for a lone row, in Python integers;
* ``generator.py``: the two decoders and their counters.

Importing the package registers the decoders.
"""

from fairseq_fastgen.sequence_generators.blockwise import generator  # noqa: F401  (registration)
