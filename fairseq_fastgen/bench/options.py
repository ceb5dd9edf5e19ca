"""Command line of fastgen-bench and the list of configurations it measures.

The bench's own options (lists of decoders, beam sizes, batch sizes, ...) are
parsed first; every other argument goes to fairseq's generation parser, so
DATA, ``--path`` and every fairseq-generate option (``--lenpen``,
``--max-len-b``, ``--no-repeat-ngram-size``, ``--post-process``, ``--cpu``,
...) mean what they mean in fairseq-generate.
"""

import argparse
import copy
import shlex
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from fairseq_fastgen.engine.choice import AUTO_ON_CPU, engine_choice
from fairseq_fastgen.option_checks import UsageError, check_generation_options, flag
from fairseq_fastgen.options import parse_options
from fairseq_fastgen.registry import DECODERS

CTRANSLATE2 = "ctranslate2"  # the peer, measured beside the registered decoders
STOCK_PROCESS = "fairseq"  # --whole-process: stock fairseq-generate without the plugin
FAIRSEQ_DEFAULT_MAX_TOKENS = 12000  # fairseq-generate's batching when neither limit is given
# decoders that produce one hypothesis per sentence: measured once per batching, at beam 1
BEAM_ONE_DECODERS = ("greedy", "greedy-stream", "blockwise", "blockwise-stream")
# decoders that need a k-head model: they decode with --khead-path when it is given
KHEAD_DECODERS = ("blockwise", "blockwise-stream")

USAGE = """fastgen-bench DATA --path CKPT --decoders beam,greedy[,...] [--beam 1,5] [--batch-size 1,64]
                     [--max-tokens N,...] [--repeat N] [--threads N] [--subset test] [--max-sentences N]
                     [--khead-path CKPT] [--cluster-projection FILE] [--variant NAME=OPTIONS ...]
                     [--reference CONFIG] [--output-dir DIR] [--no-ctranslate2]
                     [--ctranslate2-compute-type TYPE] [fairseq-generate options]
       fastgen-bench --plot-sizes OUT.png NAME=RESULTS NAME=RESULTS [NAME=RESULTS ...]"""


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration: a decoder at one beam size and one batching."""

    decoder: str  # a registered decoder, or CTRANSLATE2
    beam: int
    batch_size: Optional[int]  # sentences per batch (fairseq's --batch-size), or None
    max_tokens: Optional[int]  # source tokens per batch (fairseq's --max-tokens), or None
    cluster_projection: bool = False  # decode with --cluster-projection
    variant: Optional[str] = None  # name of a --variant: its generation options replace the common ones

    @property
    def label(self) -> str:
        parts = [self.decoder, f"b{self.beam}"]
        if self.batch_size is not None:
            parts.append(f"bs{self.batch_size}")
        if self.max_tokens is not None:
            parts.append(f"mt{self.max_tokens}")
        if self.cluster_projection:
            parts.append("cp")
        if self.variant is not None:
            parts.append(self.variant)
        return "/".join(parts)

    @property
    def batching(self) -> Tuple[Optional[int], Optional[int]]:
        return self.batch_size, self.max_tokens


def int_list(text: str) -> List[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def name_list(text: str) -> List[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastgen-bench", usage=USAGE, allow_abbrev=False,
        description="Measure decoders side by side on one model and data-bin: speed (median of warm passes), "
                    "BLEU, decoder statistics, peak memory and identical outputs against a reference "
                    "configuration. Every argument not listed here goes to fairseq's generation parser "
                    "(see fairseq-generate --help).",
    )
    parser.add_argument("--decoders", type=name_list, default=["beam", "greedy"],
                        help="comma-separated registered decoders to measure ('beam' is stock fairseq); "
                             f"registered: {', '.join(DECODERS)}")
    parser.add_argument("--beam", type=int_list, default=[1, 5],
                        help="comma-separated beam sizes (greedy and blockwise run at beam 1 only)")
    parser.add_argument("--batch-size", type=int_list, default=None,
                        help="comma-separated batch sizes in sentences (fairseq's --batch-size)")
    parser.add_argument("--max-tokens", type=int_list, default=None,
                        help="comma-separated batch limits in tokens (fairseq's --max-tokens); with "
                             f"--batch-size every pair is measured; neither: --max-tokens {FAIRSEQ_DEFAULT_MAX_TOKENS}")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed passes over the data per configuration, after one warm-up pass")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of torch and CTranslate2 (default: torch's default, one per core); "
                             "on a machine shared with other jobs, 1 avoids threads waiting on each other")
    parser.add_argument("--subset", default="test", help="data split to decode (fairseq's --gen-subset)")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="decode only the sentences with ids below N (here not fairseq's alias of "
                             "--batch-size)")
    parser.add_argument("--khead-path", default=None,
                        help=f"checkpoint of a k-head model for {', '.join(KHEAD_DECODERS)} (same data-bin)")
    parser.add_argument("--cluster-projection", default=None,
                        help="cluster file: every decoder is also measured with the cluster-projected "
                             "vocabulary (configurations marked /cp); the configurations without a file time "
                             "their full projection in one more, untimed pass")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="also measure every configuration with these generation options added to the "
                             "common ones, labelled /NAME; repeatable (e.g. --variant 'copies=--no-shared-"
                             "encoder-cache' or --variant 'top2=--blockwise-top-k 2')")
    parser.add_argument("--reference", default=None,
                        help="configuration the identical-output rate compares against: a label "
                             "(e.g. beam/b5/bs64), a decoder name (at the same beam and batching), or 'self' "
                             "(the same decoder without --cluster-projection or --variant); default: stock "
                             "beam at the same beam size, else the first configuration")
    parser.add_argument("--output-dir", default="fastgen-bench",
                        help="directory for results.json and the plots")
    parser.add_argument("--no-ctranslate2", action="store_true",
                        help="do not measure CTranslate2 even when it is installed")
    parser.add_argument("--ctranslate2-compute-type", default=None,
                        help="CTranslate2's compute_type (default: the precision of the decoders: int8 under "
                             "--quantize int8, bfloat16 under --quantize bf16, float16 under --fp16, else its "
                             "default, float32 on the CPU)")
    parser.add_argument("--whole-process", action="store_true",
                        help="time whole fairseq-generate processes (start-up, loading, decoding, post-processing, "
                             "printing) instead of decoding in this process; adds stock fairseq-generate without "
                             f"the plugin ('{STOCK_PROCESS}') at every beam and batching; BLEU and identical outputs "
                             "then compare the printed D- lines; no CTranslate2")
    parser.add_argument("--plot-sizes", nargs="+", default=None, metavar=("OUT.png", "NAME=RESULTS"),
                        help="measure nothing: plot sentences/s against model size from runs already made, one "
                             "results.json (or the --output-dir holding it) per size, in the order given along the "
                             "x axis, one line per configuration beside CTranslate2's and, where CTranslate2 was "
                             "measured, each one's speed over it; prints the figures as a Markdown table (e.g. "
                             "--plot-sizes sizes.png toy=bench/toy base=bench/base big=bench/big)")
    # filled by parse_command_line: variant name -> generation config / its options as given;
    # fairseq_argv: the arguments that went to fairseq's parser
    parser.set_defaults(variants={}, variant_argv={}, fairseq_argv=[])
    return parser


def parse_command_line(argv: Optional[List[str]] = None):
    """Return (bench options, fairseq config).

    ``bench.variants`` maps each --variant name to its own generation config:
    fairseq's parse of the common arguments plus the variant's options.
    With ``--plot-sizes`` (a plot of runs already made) the fairseq config is
    None, and any other argument is a misuse (:class:`UsageError`).
    """
    parser = bench_parser()
    bench, fairseq_argv = parser.parse_known_args(argv)
    if bench.plot_sizes is not None:
        defaults = vars(parser.parse_args([]))
        others = [flag(name) for name, value in defaults.items() if getattr(bench, name) != value] + fairseq_argv
        others.remove("--plot-sizes")
        if others:
            raise UsageError("--plot-sizes plots runs already made and takes no other argument; "
                             f"got {' '.join(others)}")
        return bench, None
    unknown = [name for name in bench.decoders if name not in DECODERS]
    if unknown:
        parser.error(f"unknown decoder(s) {', '.join(unknown)}; registered: {', '.join(DECODERS)}")
    if bench.repeat < 1:
        parser.error("--repeat must be at least 1")
    if bench.threads is not None and bench.threads < 1:
        parser.error("--threads must be at least 1")
    if bench.max_sentences is not None and bench.max_sentences < 1:
        parser.error(f"--max-sentences must be at least 1, got {bench.max_sentences}")
    if bench.whole_process and bench.max_sentences is not None:
        parser.error("--max-sentences: a --whole-process run decodes the whole --subset, as fairseq-generate does")
    bench.fairseq_argv = fairseq_argv
    for variant in bench.variant:
        name, separator, variant_argv = variant.partition("=")
        if not separator or not name or "/" in name or name in bench.variants:
            parser.error(f"--variant {variant!r}: expected a new NAME=OPTIONS, NAME without '/'")
        bench.variants[name] = fairseq_config(fairseq_argv + shlex.split(variant_argv), bench.subset).generation
        bench.variant_argv[name] = variant_argv
    cfg = fairseq_config(fairseq_argv, bench.subset)
    for label, generation in [("", cfg.generation)] + [(f"--variant {n}: ", g) for n, g in bench.variants.items()]:
        try:  # refused here, not as a configuration skipped for a ValueError
            check_generation_options(parse_options(generation))
        except ValueError as error:
            parser.error(f"{label}{error}")
    return bench, cfg


def fairseq_config(fairseq_argv: List[str], subset: str):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, fairseq_argv + ["--gen-subset", subset])
    with warnings.catch_warnings():  # hydra's deprecation notices about fairseq's own config files
        warnings.simplefilter("ignore", UserWarning)
        return convert_namespace_to_omegaconf(args)


def batchings(bench) -> List[Tuple[Optional[int], Optional[int]]]:
    if bench.batch_size and bench.max_tokens:
        return [(size, tokens) for size in bench.batch_size for tokens in bench.max_tokens]
    if bench.batch_size:
        return [(size, None) for size in bench.batch_size]
    return [(None, tokens) for tokens in bench.max_tokens or [FAIRSEQ_DEFAULT_MAX_TOKENS]]


def configurations(bench, with_ctranslate2: bool) -> List[BenchConfig]:
    """Every decoder x beam x batching (x projection) requested, without repeats; the peers
    (CTranslate2, or stock fairseq-generate in a --whole-process run) once per beam and batching."""
    projections = [False, True] if bench.cluster_projection else [False]
    variants = [None] + list(bench.variants)
    peers = [STOCK_PROCESS] if bench.whole_process else []
    peers += [CTRANSLATE2] if with_ctranslate2 else []
    decoders = list(bench.decoders) + peers
    configs = []
    for batch_size, max_tokens in batchings(bench):
        for beam in bench.beam:
            for decoder in decoders:
                for projected in projections:
                    for variant in variants:
                        if decoder in peers and (projected or variant is not None):
                            continue  # the plugin's options do not reach the peers
                        decoder_beam = 1 if decoder in BEAM_ONE_DECODERS else beam
                        config = BenchConfig(decoder, decoder_beam, batch_size, max_tokens, projected, variant)
                        if config not in configs:
                            configs.append(config)
    return configs


def projects_on_clusters(bench) -> bool:
    """Whether some configuration of the run decodes with a cluster file (common or a variant's)."""
    return bool(bench.cluster_projection) or any(
        getattr(generation, "cluster_projection", None) for generation in bench.variants.values())


def has_cluster_file(config: BenchConfig, bench) -> bool:
    """Whether this configuration decodes with a cluster file (the common one, or its variant's own)."""
    variant = bench.variants.get(config.variant) if config.variant is not None else None
    return config.cluster_projection or bool(getattr(variant, "cluster_projection", None))


def times_projection_apart(config: BenchConfig, bench) -> bool:
    """Whether a pass of its own times this configuration's full projection: the plugin's decoders (stock beam
    included) without a cluster file, in a run where another configuration has one."""
    return (projects_on_clusters(bench) and not has_cluster_file(config, bench)
            and config.decoder not in (CTRANSLATE2, STOCK_PROCESS))


def decodes_with_khead(config: BenchConfig, bench) -> bool:
    """Whether this configuration decodes with the --khead-path model instead of --path."""
    return bench.khead_path is not None and config.decoder in KHEAD_DECODERS


# generation options that only mean something with a cluster file (refused without one), at their defaults
CLUSTER_FILE_OPTIONS = {"cluster_nearest": 1, "cluster_full_normalizer": False, "cluster_union_normalizer": False}


def run_config(cfg, config: BenchConfig, cluster_projection: Optional[str], variants: Optional[Dict] = None,
               time_projection: bool = False):
    """fairseq's config for one configuration: its options, beam, batching, decoder and projection.

    With ``time_projection`` a configuration without a cluster file times its full
    vocabulary projection (``--time-projection``): the pass that times the baseline
    of the projection speedup.

    A decoder's ``prepare_cli`` hook adjusts it as fairseq-generate would (the
    streaming decoders read whole pools and stream them through the batch size).
    """
    run_cfg = copy.deepcopy(cfg)
    if config.variant is not None:
        run_cfg.generation = copy.deepcopy(variants[config.variant])
    steady_engine(run_cfg)
    run_cfg.dataset.batch_size, run_cfg.dataset.max_tokens = config.batching
    run_cfg.generation.beam = config.beam
    run_cfg.generation.decoder = config.decoder
    if config.cluster_projection:  # otherwise the common options (None) or the variant's own file
        run_cfg.generation.cluster_projection = cluster_projection
    elif cluster_projection and not run_cfg.generation.cluster_projection:  # the decoder without the common file:
        for name, default in CLUSTER_FILE_OPTIONS.items():  # nor the options that only a file reads
            setattr(run_cfg.generation, name, default)
    if time_projection and not run_cfg.generation.cluster_projection:
        run_cfg.generation.time_projection = True
    entry = DECODERS.get(config.decoder)
    if entry is not None and entry.prepare_cli is not None:
        entry.prepare_cli(run_cfg, "generate")
    return run_cfg


def steady_engine(run_cfg):
    """``--step-engine auto`` where it runs the compiled engine with its units compiled in the background: the
    bench names that engine (``compiled --compiled-freezing``) and compiles its units in the warm-up pass instead,
    so that the timed passes measure what the default runs once its units are on disk (a first run's eager steps
    are ``benchmarks/engine_whole_process.sh``'s)."""
    generation = run_cfg.generation
    if str(generation.step_engine) != "auto" or not (run_cfg.common.cpu or not torch.cuda.is_available()):
        return
    if engine_choice(generation) == AUTO_ON_CPU:
        generation.step_engine, generation.compiled_freezing = "compiled", True
