"""fairseq_fastgen: fast sequence generation for fairseq.

Load it with ``--user-dir fairseq_fastgen`` (fairseq-train, fairseq-generate,
fairseq-interactive) or ``import fairseq_fastgen``; importing registers the
decoders (``--decoder``), models, criterions and tasks, and installs the
integration described in :mod:`fairseq_fastgen.integration`.
"""

import logging

# fairseq imports every task, and its text_to_speech task logs "Please install tensorboardX" at INFO on import: a
# line no translation needs, which a console script of the plugin (it imports the plugin before fairseq) keeps quiet
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

from fairseq_fastgen import sequence_generators  # noqa: E402, F401  (registers decoders)
from fairseq_fastgen import models, criterions, tasks  # noqa: E402, F401  (fairseq registries)
from fairseq_fastgen.integration import install as _install  # noqa: E402

_install()

__version__ = "0.1.0"
