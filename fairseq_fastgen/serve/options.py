"""fastgen-serve's command line: fairseq-interactive's options plus the server's own.

DATA, ``--path``, ``--source-lang``, ``--bpe``, ``--tokenizer``, ``--decoder`` and every other option mean what they
mean in fairseq-interactive (the same parser); the server's options are one more group of that parser, so
``fastgen-serve --help`` lists them with the rest.  ``--batch-size`` is the capacity of the running batch (the
streaming decoders' ``--stream-capacity``), ``DEFAULT_CAPACITY`` sentences unless given.

A misuse of the command line ends it with one ``fastgen-serve: error: ...`` line and exit status 2 (argparse's
convention, without its usage block; ``--help`` shows the usage).
"""

import argparse
import contextlib
import io
import sys
from typing import List, Optional, Tuple

from fairseq import options as fairseq_options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import fairseq_fastgen  # noqa: F401  (registers the plugin's options before fairseq builds its parser)

BATCHING = ("continuous", "fixed")
DEFAULT_CAPACITY = 32  # sentences in the running batch when neither --batch-size nor --max-tokens is given
PROGRAM = "fastgen-serve"


def add_server_options(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("fastgen-serve", "the HTTP server (POST /translate, GET /health, GET /metrics)")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    group.add_argument("--port", type=int, default=8000,
                       help="port to listen on; 0: a free port, printed in the 'listening on' line")
    group.add_argument("--batching", choices=BATCHING, default="continuous",
                       help="continuous: every sentence of every client enters one running stream as soon as a row "
                            "is free (a streaming decoder: greedy-stream, blockwise-stream, var-stream, "
                            "fixed-stream); fixed: collect up to --fixed-batch-size sentences or "
                            "--fixed-batch-wait-ms, decode them as one batch, then the next (any decoder; on a CPU it "
                            "answered first at every load measured: docs/serving.md)")
    group.add_argument("--fixed-batch-size", type=int, default=None,
                       help="--batching fixed: sentences in one batch at most (default: --batch-size)")
    group.add_argument("--fixed-batch-wait-ms", type=float, default=10.0,
                       help="--batching fixed: how long the first sentence of a batch waits for others to join it")
    group.add_argument("--max-sentences-per-request", type=int, default=64,
                       help="a request with more sentences is refused (413)")
    group.add_argument("--max-source-tokens", type=int, default=None,
                       help="a sentence with more tokens (after --tokenizer and --bpe, with eos) is refused (413); "
                            "default: what the model reads (its max source positions)")
    group.add_argument("--max-queue", type=int, default=1024,
                       help="sentences that may wait for a place in the batch; a request that does not fit is "
                            "refused (503 with Retry-After)")
    group.add_argument("--retry-after", type=int, default=1,
                       help="seconds a 503's Retry-After header asks the client to wait")
    group.add_argument("--request-timeout", type=float, default=30.0,
                       help="seconds a request may take before it is answered 504 and its sentences leave the "
                            "batch; a request may ask for less with its 'timeout' field")
    group.add_argument("--grace-period", type=float, default=30.0,
                       help="after SIGTERM or SIGINT (no new connections, new requests 503): seconds the requests "
                            "in flight have to finish before they are answered 503; then the server exits 0")
    group.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="a larger request body is refused (413)")
    group.add_argument("--peer", choices=("ctranslate2",), default=None,
                       help="for the serving benchmark: CTranslate2 decodes the fixed batches (--batching fixed, "
                            "--decoder greedy or beam; the checkpoint converted once, cached) behind the same server, "
                            "queue, batching and text processing, in the precision --quantize names (int8, "
                            "bfloat16; else float32)")
    ray = parser.add_argument_group("fastgen-serve on Ray Serve", "N replicas of the server as one Ray Serve "
                                    "deployment (needs the extra: pip install 'fairseq_fastgen[ray]')")
    ray.add_argument("--ray-replicas", type=int, default=0,
                     help="run this many replicas of the server (each loads the model and runs its own batch) as a "
                          "Ray Serve deployment; Ray Serve's proxy listens on --host/--port and spreads the requests "
                          "over them (0: this process serves, without Ray)")
    ray.add_argument("--ray-address", default=None,
                     help="with --ray-replicas: the Ray cluster to deploy on ('auto': the one running on this "
                          "machine; ray://HOST:PORT: a remote one); default: start a local one for this process")
    ray.add_argument("--ray-cpus-per-replica", type=float, default=1.0,
                     help="with --ray-replicas: CPUs Ray reserves for each replica (its torch threads)")


def check_server_options(args: argparse.Namespace):
    """Range checks of the server's options; a misuse raises ValueError with the message."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535; got {args.port}")
    for name in ("fixed_batch_size", "max_sentences_per_request", "max_source_tokens", "max_queue",
                 "max_request_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1; got {value}")
    for name in ("fixed_batch_wait_ms", "request_timeout", "grace_period"):
        value = getattr(args, name)
        if not value >= 0 or value == float("inf"):  # NaN fails both
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0; got {value}")
    if args.request_timeout == 0:
        raise ValueError("--request-timeout must be above 0")
    if args.retry_after < 0:
        raise ValueError(f"--retry-after must be >= 0; got {args.retry_after}")
    if args.ray_replicas < 0:
        raise ValueError(f"--ray-replicas must be >= 0; got {args.ray_replicas}")
    if args.ray_replicas and args.port == 0:
        raise ValueError("--ray-replicas needs a --port (Ray Serve's proxy does not pick a free one)")
    if not args.ray_cpus_per_replica >= 0 or args.ray_cpus_per_replica == float("inf"):
        raise ValueError(f"--ray-cpus-per-replica must be a finite number >= 0; got {args.ray_cpus_per_replica}")


def parse_command_line(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, object]:
    """(the parsed arguments, fairseq's config of them).  A misuse prints one error line and exits 2."""
    parser = fairseq_options.get_interactive_generation_parser()
    add_server_options(parser)
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        args = fairseq_options.parse_args_and_arch(parser, argv)
    try:
        check_server_options(args)
    except ValueError as error:
        usage_exit(str(error))
    if args.batch_size is None and args.max_tokens is None:
        args.batch_size = DEFAULT_CAPACITY
    if args.fixed_batch_size is None:
        args.fixed_batch_size = args.batch_size or DEFAULT_CAPACITY
    args.buffer_size = max(args.buffer_size, args.batch_size or 1)  # fairseq-interactive's rule of the two
    return args, convert_namespace_to_omegaconf(args)


def usage_exit(message: str):
    print(f"{PROGRAM}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


@contextlib.contextmanager
def one_line_errors():
    """argparse prints its usage block before the error line: only the error line is kept (``--help`` is not
    touched: it exits 0 and prints to stdout)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except SystemExit as exit:
        if exit.code not in (0, None):
            errors = [line for line in captured.getvalue().splitlines() if ": error: " in line]
            usage_exit(errors[-1].split(": error: ", 1)[1] if errors else "invalid command line")
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())
