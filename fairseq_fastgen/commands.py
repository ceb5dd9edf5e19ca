"""fairseq's command line tools as the plugin runs them, with and without the plugin.

fastgen-bench's ``--whole-process`` passes run them; so do the demo and the tests
(``fastgen_demo.toy``).
"""

import sys
from pathlib import Path
from typing import List

PLUGIN_DIR = str(Path(__file__).resolve().parent)  # the --user-dir argument


def fairseq_command(tool: str) -> List[str]:
    """The fairseq console script (fairseq-generate, ...) of the running interpreter's
    environment, so it works without the virtual environment on PATH."""
    script = Path(sys.executable).parent / f"fairseq-{tool}"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", f"from fairseq_cli.{tool} import cli_main; cli_main()"]


def stock_fairseq_command(tool: str) -> List[str]:
    """Stock fairseq's ``fairseq-TOOL`` without the plugin, loading checkpoints with only fairseq's
    globals allowed (torch's weights_only protection stays on; see fairseq_fastgen/stock_fairseq.py)."""
    return [sys.executable, str(Path(__file__).with_name("stock_fairseq.py")), tool]
