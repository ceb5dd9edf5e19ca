"""Run stock fairseq's command line (without the plugin) on checkpoints saved by this torch.

    python path/to/fairseq_fastgen/stock_fairseq.py generate DATA --path CKPT ...

The stock side of every comparison (benchmarks, tests).  torch >= 2.6 loads
with ``weights_only=True`` and refuses the few globals fairseq checkpoints
pickle; instead of switching that protection off, this allows exactly those
globals (:mod:`fairseq_fastgen.checkpoint_safety`) and nothing of the plugin
else.  It runs as a script, by path: importing the package would install the
plugin (``fairseq_fastgen/__init__.py``), so ``checkpoint_safety.py`` is loaded
from its file.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def allow_fairseq_checkpoint_globals():
    spec = importlib.util.spec_from_file_location("_fastgen_checkpoint_safety", HERE / "checkpoint_safety.py")
    checkpoint_safety = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoint_safety)
    checkpoint_safety.allow_fairseq_checkpoint_globals()
    checkpoint_safety.allow_user_trusted_globals()


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: stock_fairseq.py TOOL [fairseq-TOOL arguments], e.g. generate")
    if sys.path and Path(sys.path[0]).resolve() == HERE:
        del sys.path[0]  # the package's own modules must not shadow top-level names
    tool = sys.argv[1]
    allow_fairseq_checkpoint_globals()
    cli = importlib.import_module(f"fairseq_cli.{tool}")
    sys.argv = [f"fairseq-{tool}"] + sys.argv[2:]
    cli.cli_main()


if __name__ == "__main__":
    main()
