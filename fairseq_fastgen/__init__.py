"""fairseq_fastgen: fast sequence generation for fairseq.

Load it with ``--user-dir fairseq_fastgen`` (fairseq-train, fairseq-generate,
fairseq-interactive) or ``import fairseq_fastgen``; importing registers the
decoders (``--decoder``), models, criterions and tasks, and installs the
integration described in :mod:`fairseq_fastgen.integration`.
"""

from fairseq_fastgen import sequence_generators  # noqa: F401  (registers decoders)
from fairseq_fastgen import models, criterions, tasks  # noqa: F401  (fairseq registries)
from fairseq_fastgen.integration import install as _install

_install()

__version__ = "0.1.0"
