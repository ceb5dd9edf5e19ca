"""fastgen-serve: a translation server over one model, sentences of every client decoded in one running batch.

Read top to bottom: ``options.py`` (the command line: fairseq-interactive's plus the server's), ``translator.py``
(the model and fairseq-interactive's pre- and post-processing, loaded once), ``batching.py`` (the decoding thread:
continuous batching through one live stream, or fixed batches), ``metrics.py`` (Prometheus' text format) and
``app.py`` (the HTTP routes, refusals, streaming and the SIGTERM shutdown); ``server_setup.py`` checks the options
and builds them; ``ray_serve.py`` runs N replicas of it as a Ray Serve deployment (``--ray-replicas``).
Usage: docs/serving.md.
"""

import asyncio
import logging
import sys
from typing import List, Optional

from fairseq_fastgen.option_checks import exit_on_usage_error
from fairseq_fastgen.serve.options import PROGRAM, parse_command_line
from fairseq_fastgen.serve.ray_serve import serve_replicas
from fairseq_fastgen.serve.server_setup import build_server


def cli_main(argv: Optional[List[str]] = None):
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        level=logging.INFO, stream=sys.stderr, force=True)  # (fairseq configured it at import)
    args, cfg = parse_command_line(argv)
    if args.ray_replicas:
        exit_on_usage_error(PROGRAM)(serve_replicas)(args, cfg, sys.argv[1:] if argv is None else argv)
    else:
        exit_on_usage_error(PROGRAM)(serve)(args, cfg)


def serve(args, cfg):
    server = build_server(args, cfg)
    asyncio.run(server.run())
