"""What ``fastgen-serve`` builds before it listens, alone or in each Ray Serve replica: the options checked
(:func:`prepare`), then the model, its batching thread and the HTTP side (:func:`build_server`)."""

import logging
import time

from fairseq_fastgen.engine import engine_setting
from fairseq_fastgen.integration import check_checkpoint_files
from fairseq_fastgen.option_checks import (UsageError, check_fairseq_generation_options, check_generation_options,
                                           usage_errors)
from fairseq_fastgen.options import parse_options
from fairseq_fastgen.registry import DECODERS
from fairseq_fastgen.sequence_generators.streaming import prepare_streaming_cli
from fairseq_fastgen.serve.app import Server
from fairseq_fastgen.serve.batching import ContinuousBatching, FixedBatching
from fairseq_fastgen.serve.metrics import Metrics
from fairseq_fastgen.serve.peer import CTranslate2Generator
from fairseq_fastgen.serve.translator import Translator

logger = logging.getLogger("fairseq_fastgen.serve")


def build_server(args, cfg) -> Server:
    """The model loaded, the decoding thread started, the HTTP side ready to answer (not yet listening)."""
    prepare(args, cfg)
    limits = [(option, value) for option, value in (("--max-source-tokens", args.max_source_tokens),
                                                    ("--max-tokens", args.max_tokens)) if value is not None]
    with usage_errors():  # a decoder that does not fit the model: one line
        translator = Translator(cfg, limits)
        if args.peer == "ctranslate2":  # the benchmark's peer decodes the fixed batches (serve/peer.py)
            translator.generator = CTranslate2Generator(cfg, translator)
    if args.peer is None and engine_setting(cfg.generation, translator.models[0]) == "compiled":
        warm_up(translator, args.fixed_batch_size if args.batching == "fixed" else cfg.dataset.batch_size or 8)
    metrics = Metrics()
    if args.batching == "continuous":
        batching = ContinuousBatching(translator, metrics, args.max_queue)
    else:
        batching = FixedBatching(translator, metrics, args.max_queue, args.fixed_batch_size,
                                 args.fixed_batch_wait_ms / 1000)
    batching.start()
    return Server(args, translator, batching, metrics)


def warm_up(translator: Translator, most_rows: int):
    """--step-engine compiled (or auto where it runs compiled): its units for 1 to ``most_rows`` rows loaded (or
    compiled; under auto in the background) before the server listens, one line saying how long it took."""
    start = time.perf_counter()
    sizes = translator.warm_up(most_rows)
    logger.info("fastgen-serve: warmed up --step-engine compiled in %.1f s (batches of %s rows)",
                time.perf_counter() - start, ", ".join(map(str, sizes)))


def prepare(args, cfg):
    """The plugin's checks of the options before the model loads (as fairseq-interactive's run), and the stream's
    capacity for continuous batching: ``--batch-size`` (or ``--max-tokens``)."""
    with usage_errors():
        options = parse_options(cfg.generation)
        check_fairseq_generation_options(cfg.generation)
        check_generation_options(options)
        name = str(options.common.decoder)
        entry = DECODERS.get(name)
        if entry is None:
            raise UsageError(f"unknown --decoder {name!r}; choose one of: {', '.join(DECODERS)}")
        if args.peer and args.batching != "fixed":
            raise UsageError(f"--peer {args.peer} decodes fixed batches (it cannot take sentences into a batch that "
                             f"is decoding): add --batching fixed")
        if args.peer and name not in ("greedy", "beam"):
            raise UsageError(f"--peer {args.peer} decodes with greedy or beam search, not --decoder {name}")
        if cfg.generation.constraints:
            raise UsageError("fastgen-serve does not take lexical constraints (--constraints)")
        streams = entry.prepare_cli is prepare_streaming_cli
        if args.batching == "continuous":
            if not streams:
                raise UsageError(f"--batching continuous runs one stream across requests, which --decoder {name} "
                                 f"does not: use a streaming decoder (greedy-stream, blockwise-stream, var-stream, "
                                 f"fixed-stream) or --batching fixed")
            prepare_streaming_cli(cfg, "interactive")  # the capacity from --batch-size / --max-tokens
    check_checkpoint_files(cfg)
