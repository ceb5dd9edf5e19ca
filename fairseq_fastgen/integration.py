"""The plugin's patches of fairseq's modules, in one place; its changes to the objects fairseq builds are in
the adapters beside it (:mod:`fairseq_fastgen.adapters`, and ``fastseq/`` for FastSeq's optimizations).

fairseq has no extension point for decoding algorithms, generation options or
checkpoint allow-lists, so the plugin patches a few names when it is imported
(``--user-dir fairseq_fastgen`` or ``import fairseq_fastgen``).  Each patch
says why it is needed.  They were written against fairseq 0.12.x (the
``fairseq-fixed`` 0.12.3.1 fork); :func:`install` warns on any other version.

1. Checkpoint loading: torch >= 2.6 loads with ``weights_only=True``; we allow
   the globals fairseq checkpoints contain and explain any other refusal; a
   file torch cannot read (truncated, damaged) is named in a one-line error.
2. Generation options: fairseq reads them from one dataclass,
   ``GenerationConfig``; we substitute a subclass holding ``--decoder`` and
   every decoder's options, so they appear in ``--help`` and reach
   ``cfg.generation`` (a separate registry crashes fairseq's config conversion).
3. ``FairseqTask.build_generator``: builds the decoder named by ``--decoder``,
   after checking every numeric plugin option (:mod:`fairseq_fastgen.option_checks`).
   For ``--decoder beam`` it builds fairseq's own generator and then applies,
   to that instance only, the cluster projection (attached to the model's
   decoder only while that generator's ``generate`` runs, as other generators
   may share the model: :mod:`fairseq_fastgen.adapters.output_layer`), the
   step engine's runner under fairseq's search (:mod:`fairseq_fastgen.engine.stock_search`,
   on every engine: the beams' keys shared in the runner's cache) and the FastSeq
   optimizations (:func:`fairseq_fastgen.fastseq.optimize_stock_generator`: the
   lean loop, n-gram banning that works on CPU, and, where no runner serves the
   model, encoder and prompt caches shared by the beams unless
   ``--no-shared-encoder-cache``).  For every decoder, ``--onednn-linear`` routes the
   model's linear layers through oneDNN while that generator generates
   (:mod:`fairseq_fastgen.adapters.linear_forwards`), and, unless
   ``--no-reuse-large-allocations``, the process's malloc thresholds are raised
   (:mod:`fairseq_fastgen.ops.heap`).
   Every generator generates under ``torch.inference_mode`` unless
   ``--no-inference-mode`` (:mod:`fairseq_fastgen.adapters.inference_mode`).
4. ``data_utils.batch_by_size``: fairseq drops the last batch when its size is
   not a multiple of ``--required-batch-size-multiple`` (default 8), so
   fairseq-generate silently loses sentences; we keep that batch.  And
   ``FairseqTask.get_batch_iterator`` refuses any batching that loses sentences.
   During a fairseq-generate run, a sentence longer than ``--max-tokens`` is
   left out of the batches and refused alone (fairseq asserted on it, ending
   the run with a traceback; :mod:`fairseq_fastgen.cli.generate_run`).
5. ``fairseq_cli.generate._main`` / ``fairseq_cli.interactive.main``: let the
   selected decoder adjust the run (``prepare_cli``: streaming decoders read
   larger pools), run the plugin's asynchronous generate loop when
   ``--postprocess-workers`` > 0, and report the decoders' statistics.
   In fairseq-interactive, ``make_batches`` is wrapped for the run
   (:mod:`fairseq_fastgen.cli.oversized_lines`): a line longer than the model
   reads is refused alone with an error naming it, instead of a traceback
   that ends the run with the other lines untranslated.  Both commands run
   with SIGTERM and SIGINT ending them between whole batches of output
   (:mod:`fairseq_fastgen.cli.batched_output`: fairseq-interactive's
   ``buffered_read`` and ``sys.stdout`` are swapped for the run, and each
   generator fairseq-generate builds starts a batch at each call).  A
   ``--path`` that does not exist or cannot be read is refused in one line
   before anything loads.
   ``fairseq_cli.train.main`` (when fairseq-train loads the plugin): a
   refused k-head, criterion or distillation option
   (:class:`fairseq_fastgen.refusals.UsageError`) ends it with one
   ``fairseq-train: error:`` line and exit status 2, not a traceback.
6. ``numpy.compat``: fairseq 0.12 reads ``np.compat.long`` (removed in numpy 2)
   when it builds a language model's dataset (``TokenBlockDataset``, eos break
   mode: fairseq-interactive and the hub interface of ``transformer_lm``) and a
   bucketed ``LanguagePairDataset``; we provide that one name (int64) when numpy
   lacks it.
7. oneDNN's primitive cache: unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is set,
   the plugin sets it to 32 (oneDNN's default: 1024) before any oneDNN product
   runs.  The compiled engine's unit for many rows (and ``--onednn-linear``)
   makes a primitive per row count, each kept with its memory: at beam 5,
   batch 64, capped, it holds less memory at the same speed.
8. ``Dictionary.add_from_file``: a data-bin without a dictionary the task
   reads (``dict.en.txt``) ended every tool in a ``FileNotFoundError``
   traceback; the plugin's :class:`UsageError` names the file instead (one
   ``error:`` line, exit status 2).  And fairseq's ``--beam 0`` (a
   ``RuntimeError`` deep in its search) or ``--nbest 0`` is refused in one line
   with the plugin's options, before the model loads.
9. ``FairseqTask.train_step``: fairseq's ``--amp`` autocasts on CUDA only; under
   ``fairseq-train --cpu --amp`` the step's forward runs in bfloat16 autocast
   where the processor multiplies bfloat16 natively, float32 weights and
   optimizer as on a GPU (:mod:`fairseq_fastgen.adapters.cpu_amp`).  Tasks
   that replace ``train_step`` without calling fairseq's (multilingual,
   Levenshtein) train in float32 as before.
"""

import contextlib
import functools
import gc
import logging
import os
import pickle
import sys
from typing import Optional, Tuple

import fairseq
import torch
from fairseq import checkpoint_utils, utils
from fairseq.dataclass import configs as fairseq_configs
from fairseq.tasks.fairseq_task import FairseqTask

from fairseq_fastgen import checkpoint_safety
from fairseq_fastgen.adapters.cpu_amp import training_precision
from fairseq_fastgen.adapters.ensemble import restore_ensemble
from fairseq_fastgen.adapters.generate import give_attributes, take_back_attributes, unwrap_generate
from fairseq_fastgen.adapters.inference_mode import generate_in_inference_mode
from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears, QuantizedLinears, use_linear_forwards
from fairseq_fastgen.adapters.output_layer import attach_to_stock_generator
from fairseq_fastgen.cli.async_generate import async_generate_main
from fairseq_fastgen.cli.batched_output import AnsweredTally, CountedLines, answered_buffers, stopped_between_batches
from fairseq_fastgen.cli.generate_run import GenerateRun
from fairseq_fastgen.cli.live_lines import LiveLines
from fairseq_fastgen.cli.oversized_lines import OversizedLines, TokenLimit, token_limit
from fairseq_fastgen.cluster.directory import run_direction
from fairseq_fastgen.cluster.screened import check_screen_options
from fairseq_fastgen.config import build_generation_config
from fairseq_fastgen.engine import serve_stock_search
from fairseq_fastgen.fastseq import optimize_stock_generator
from fairseq_fastgen.fastseq import restore_stock_generator as restore_fastseq
from fairseq_fastgen.ops import heap
from fairseq_fastgen.option_checks import (UsageError, check_fairseq_generation_options, check_generation_options,
                                           exit_on_usage_error, usage_errors)
from fairseq_fastgen.options import FastgenOptions, options_not_read, parse_options
from fairseq_fastgen.registry import DECODERS
from fairseq_fastgen.safe_files import check_writable
from fairseq_fastgen.sequence_generators.live_stream import LiveStream
from fairseq_fastgen.sequence_generators.streaming import StreamOptions, prepare_streaming_cli

logger = logging.getLogger(__name__)

TESTED_FAIRSEQ_VERSIONS = ("0.12.2", "0.12.3.1")

_installed = False
generators_built = []  # every generator built in this process, for the end-of-run statistics
_generate_run = None  # the fairseq-generate run in progress (cli/generate_run.py), which the hooks report to


def install():
    global _installed
    if _installed:
        return
    _installed = True
    if fairseq.__version__ not in TESTED_FAIRSEQ_VERSIONS:
        logger.warning(
            "fairseq_fastgen was written for fairseq %s; found %s", " / ".join(TESTED_FAIRSEQ_VERSIONS), fairseq.__version__
        )
    _install_checkpoint_loading()
    _install_generation_config()
    _install_build_generator()
    _install_batch_iterator()
    _install_cli_reports()
    _install_numpy_compat()
    _cap_onednn_primitive_cache()
    _install_dictionary_loading()
    _install_cpu_amp()


# ---- 1. checkpoint loading -------------------------------------------------------------
def _install_checkpoint_loading():
    checkpoint_safety.allow_fairseq_checkpoint_globals()
    original = checkpoint_utils.load_checkpoint_to_cpu

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        checkpoint_safety.allow_user_trusted_globals()  # FASTGEN_TRUSTED_GLOBALS: a bad entry refused in one line
        try:
            return original(path, *args, **kwargs)
        except pickle.UnpicklingError as error:
            if "weights_only" not in str(error) and "Unsupported global" not in str(error):
                raise checkpoint_safety.explain_unreadable(path, error) from error
            raise checkpoint_safety.explain_refusal(path, error) from error
        except checkpoint_safety.UNREADABLE_ERRORS as error:  # cut short or damaged: name the file, in one line
            raise checkpoint_safety.explain_unreadable(path, error) from error

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


# ---- 2. generation options ---------------------------------------------------------------
def _install_generation_config():
    from fairseq import options
    from fairseq.dataclass.initialize import hydra_init

    merged = build_generation_config()
    fairseq_configs.GenerationConfig = merged
    options.GenerationConfig = merged
    generation_field = fairseq_configs.FairseqConfig.__dataclass_fields__["generation"]
    generation_field.type = merged
    generation_field.default = merged
    fairseq_configs.FairseqConfig.__annotations__["generation"] = merged
    hydra_init()  # hydra stored the schema at fairseq import: store it again with our fields


# ---- 3. --decoder ---------------------------------------------------------------------------
def selected_decoder(options: FastgenOptions):
    """The registry's entry of ``--decoder``; an unknown name is refused."""
    name = str(options.common.decoder)
    entry = DECODERS.get(name)
    if entry is None:
        raise ValueError(f"unknown --decoder {name!r}; choose one of: {', '.join(DECODERS)}")
    return entry


_options_not_read_named = set()  # (decoder, flags) already named in a warning: once per process


def warn_options_not_read(entry, options: FastgenOptions):
    """One warning line naming the options of other decoders set for this one, which it does not read."""
    flags = tuple(options_not_read(entry, options))
    if flags and (entry.name, flags) not in _options_not_read_named:
        _options_not_read_named.add((entry.name, flags))
        logger.warning(f"--decoder {entry.name} does not read {', '.join(flags)}: not used")


def _install_build_generator():
    original = FairseqTask.build_generator

    @functools.wraps(original)
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        with usage_errors():
            return build_checked(self, models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)

    def build_checked(self, models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn):
        options = parse_options(args)  # the plugin's options, read once: every step below takes them typed
        entry = selected_decoder(options)
        check_fairseq_generation_options(args)  # --beam 0: fairseq's search ends in a RuntimeError
        check_generation_options(options)  # every numeric plugin option finite and in range (hub interface too)
        check_screen_options(options.common, args)  # --no-repeat-ngram-size could pick a token it did not recompute
        warn_options_not_read(entry, options)  # another decoder's option set here: named once, not silently dropped
        common = options.common
        direction = run_direction(self)  # the run's (source, target) languages: the file --cluster-projection DIR gives
        if entry.builder is None:
            generator = original(self, models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
            # stock search calls decoder.forward; --temperature read as fairseq's generator reads it
            attach_to_stock_generator(generator, models, common, getattr(args, "temperature", 1.0), entry.name,
                                      direction)
            on_engine = serve_stock_search(generator, models, common)  # fairseq's search over a runner's step
            # shared caches (where no runner serves: the runner's cache shares keys), working n-gram banning, lean loop
            optimize_stock_generator(generator, common, share_cache=not on_engine, nbest=getattr(args, "nbest", 1))
        else:
            extra = dict(extra_gen_cls_kwargs or {})
            extra["prefix_allowed_tokens_fn"] = prefix_allowed_tokens_fn
            extra["direction"] = direction
            generator = entry.builder(models, self.target_dictionary, args, options=options, **extra)
        linears = linear_forwards(models, common)
        if linears:
            use_linear_forwards(generator, linears)  # every decoder
        if common.reuse_large_allocations and common.no_reuse_large_allocations:
            raise ValueError("--reuse-large-allocations (the default) and --no-reuse-large-allocations: choose one")
        if not common.no_reuse_large_allocations:
            heap.reuse_large_allocations()  # the process's malloc settings, for the rest of the process
        if not common.no_inference_mode:
            generate_in_inference_mode(generator)  # every decoder
        give_attributes(generator, fastgen_decoder=entry.name)
        generators_built.append(generator)
        # the objects alive now (modules, weights, the imported libraries') live as long as the run: the cyclic
        # collector stops walking them at each full collection (3-5% of a greedy batch-64 run at base size)
        gc.freeze()
        if _generate_run is not None:
            _generate_run.watch(generator)  # each batch starts by writing the previous one, printed whole
        return generator

    FairseqTask.build_generator = build_generator


def linear_forwards(models, common):
    """The stand-ins of the models' linear layers that ``--quantize`` or ``--onednn-linear`` ask for, or None."""
    if common.quantize and common.onednn_linear:
        raise ValueError("--onednn-linear and --quantize both replace the linear layers' products: choose one")
    if common.float32_vocabulary_projection and not common.quantize:
        raise ValueError("--float32-vocabulary-projection applies to --quantize int8 or bf16")
    if common.int8_library_kernels and common.quantize != "int8":
        raise ValueError("--int8-library-kernels applies to --quantize int8")
    if common.quantize:
        return [QuantizedLinears(model, str(common.quantize), common.float32_vocabulary_projection,
                                 common.int8_library_kernels) for model in models]
    if common.onednn_linear:
        return [OneDNNLinears(model) for model in models]
    return None


def restore_stock_generator(generator):
    """Undo every change ``build_generator`` made to a generator fairseq built (``--decoder beam``): its
    ensemble (the step engine's, the shared caches'), its models' attention modules, its n-gram blocker, its
    loop, the wrappers of its ``generate`` (inference mode, oneDNN's products, the cluster projection, the
    run's batch output) and the attributes the plugin gave it.  The models are then as fairseq loaded them;
    returns the generator."""
    restore_ensemble(generator)
    restore_fastseq(generator)
    unwrap_generate(generator)
    take_back_attributes(generator)
    return generator


# ---- 4. no dropped sentences ----------------------------------------------------------------
def _install_batch_iterator():
    from fairseq.data import data_utils

    # fairseq imports its Cython batching module at the first batch_by_size call; a SIGTERM or SIGINT arriving while
    # that import registers its types with collections.abc is lost (Cython's module init clears the error), and a
    # run or a bench stopped at its first batch went on to its end: imported now, before any run starts
    try:
        import fairseq.data.data_utils_fast  # noqa: F401
    except ImportError:  # not built: fairseq's own call says how to build it
        pass

    original_batch_by_size = data_utils.batch_by_size

    @functools.wraps(original_batch_by_size)
    def batch_by_size(indices, *args, **kwargs):
        if _generate_run is not None and not args:  # fairseq's datasets pass every option by keyword
            indices, kwargs = _generate_run.over_budget.leave_out(indices, kwargs)  # fairseq asserted on those
        batches = original_batch_by_size(indices, *args, **kwargs)
        if kwargs.get("fixed_shapes") is not None:
            return batches
        covered = sum(len(b) for b in batches)  # batches split ``indices`` in order
        if covered < len(indices):
            batches = list(batches) + [indices[covered:]]
        return batches

    data_utils.batch_by_size = batch_by_size

    original = FairseqTask.get_batch_iterator

    @functools.wraps(original)
    def get_batch_iterator(self, dataset, *args, **kwargs):
        iterator = original(self, dataset, *args, **kwargs)
        left_out = 0
        if _generate_run is not None:
            _generate_run.batched(dataset)
            left_out = _generate_run.over_budget.left_out
        _check_every_index_batched(dataset, iterator, kwargs, left_out)
        return iterator

    FairseqTask.get_batch_iterator = get_batch_iterator


def _check_every_index_batched(dataset, iterator, kwargs, left_out=0):
    """Fail loudly instead of silently translating fewer sentences than given (``left_out``: refused, and reported,
    for their length)."""
    if kwargs.get("ignore_invalid_inputs") or kwargs.get("num_shards", 1) > 1:
        return  # the user asked fairseq to skip, or another rank holds the rest
    batched = sum(len(b) for b in iterator.frozen_batches)
    if batched + left_out != len(dataset):
        raise RuntimeError(f"batching lost {len(dataset) - batched - left_out} of {len(dataset)} sentences")


# ---- 5. end-of-run statistics ------------------------------------------------------------------
def report_statistics(stats_json, stream):
    """Print the statistics of every plugin generator built in this run, and warn in one line where sentences
    got fewer hypotheses than ``--nbest``; ``stats_json`` (``--decoder-stats-json``): also write the last one's
    there."""
    plugin_generators = [g for g in generators_built if hasattr(g, "counters")]
    for generator in plugin_generators:
        print(generator.counters.summary(), file=stream)
        shortfall = generator.counters.nbest_shortfall(getattr(generator, "nbest", 1))
        if shortfall:
            logger.warning(shortfall)  # one line, not a silent n-best shorter than asked
    if stats_json and plugin_generators:
        plugin_generators[-1].counters.write_json(stats_json)


def _prepare_run(cfg, tool) -> Tuple[FastgenOptions, Optional[TokenLimit]]:
    """Check the run's options and let the decoder adjust ``cfg``; returns the options as given (the
    generator reads them again, as ``prepare_cli`` left them, when it is built) and the token limit every
    sentence of the run is held to, whatever the decoder (``oversized_lines.token_limit``)."""
    with usage_errors():
        options = parse_options(cfg.generation)
        check_fairseq_generation_options(cfg.generation)
        check_generation_options(options)  # before the model loads, and before prepare_cli reads them
        if options.common.decoder_stats_json:  # written after the decode: found unwritable before it
            check_writable("--decoder-stats-json", options.common.decoder_stats_json)
        entry = DECODERS.get(str(options.common.decoder))
        if entry is not None and entry.prepare_cli is not None:
            entry.prepare_cli(cfg, tool)
    check_checkpoint_files(cfg)  # after the options: a bad option is named even when --path is bad too
    streams = entry is not None and entry.prepare_cli is prepare_streaming_cli
    limit = token_limit(cfg, streams, options.of(StreamOptions).stream_capacity_tokens is not None)
    return options, limit


def check_checkpoint_files(cfg):
    """Every file ``--path`` names (with ``--checkpoint-suffix`` and shards, as fairseq reads them) exists and can
    be read; fairseq's own check ends in an OSError traceback."""
    if cfg.common_eval.path is None:
        raise UsageError("--path is required: the checkpoint(s) to generate with")
    if "://" in cfg.common_eval.path:
        return  # a remote path: fairseq's PathManager reads it
    shards = cfg.checkpoint.checkpoint_shard_count
    for path in utils.split_paths(cfg.common_eval.path):
        for shard in range(shards):
            shard_path = checkpoint_utils.get_maybe_sharded_checkpoint_filename(
                path, cfg.checkpoint.checkpoint_suffix, shard, shards)
            checkpoint_safety.check_readable(shard_path)


def _cli_modules(name):
    """The module objects of a fairseq CLI: imported by the console script, and
    ``__main__`` as well when it runs as ``python -m fairseq_cli.NAME``."""
    import importlib

    modules = [importlib.import_module(f"fairseq_cli.{name}")]
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == f"fairseq_cli.{name}":
        modules.append(main)
    return modules


def _install_cli_reports():
    if "fairseq_cli.train" in sys.modules:  # fairseq-train, loading the plugin through --user-dir
        for train_cli in _cli_modules("train"):  # its cli_main calls the module's main(cfg) by name
            train_cli.main = exit_on_usage_error("fairseq-train")(train_cli.main)
    for generate_cli in _cli_modules("generate"):
        generate_cli._main = _wrap_generate_main(generate_cli._main)
    for interactive_cli in _cli_modules("interactive"):
        interactive_cli.main = _wrap_interactive_main(interactive_cli.main)


@contextlib.contextmanager
def _watching(run):
    """Within the block, the hooks report to ``run`` (a :class:`GenerateRun`)."""
    global _generate_run
    _generate_run = run
    try:
        yield run
    finally:
        _generate_run = None


@contextlib.contextmanager
def _swapped(module, **replacements):
    """Within the block, ``module``'s names are bound to the replacements (for one CLI run)."""
    originals = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)


def _wrap_generate_main(original_generate):
    @functools.wraps(original_generate)
    @exit_on_usage_error("fairseq-generate")
    def generate_main(cfg, output_file):
        generators_built.clear()
        options, limit = _prepare_run(cfg, "generate")
        workers = options.common.postprocess_workers
        with _watching(GenerateRun(cfg, limit)) as run:
            if workers > 0:
                scorer = async_generate_main(cfg, output_file, workers)  # its own signal handling, between batches too
            else:
                with stopped_between_batches("fairseq-generate", output_file, run.tally) as run.output:
                    scorer = original_generate(cfg, run.output)
        report_statistics(options.common.decoder_stats_json, output_file)
        run.exit_if_refused()
        return scorer

    return generate_main


def _wrap_interactive_main(original_interactive):
    @functools.wraps(original_interactive)
    @exit_on_usage_error("fairseq-interactive")
    def interactive_main(cfg):
        generators_built.clear()
        options, limit = _prepare_run(cfg, "interactive")
        if options.common.postprocess_workers:  # its loop answers a buffer at a time, each answer printed at once
            logger.warning(f"--postprocess-workers applies to fairseq-generate; fairseq-interactive prints each "
                           f"answer in its own loop: --postprocess-workers {options.common.postprocess_workers} is "
                           f"not used")
        interactive_cli = sys.modules[original_interactive.__module__]
        oversized = OversizedLines(interactive_cli.make_batches, limit)
        live = _live_lines(options, cfg, oversized)
        lines = CountedLines() if live is None else live  # each counts the lines it read: a stop reports them
        with stopped_between_batches("fairseq-interactive", sys.stdout, AnsweredTally(lambda: lines.lines_read)) \
                as output:
            read = answered_buffers(lines.buffered_read, output)
            make_batches = oversized.make_batches if live is None else live.make_batches
            with _swapped(interactive_cli, make_batches=make_batches, buffered_read=read), \
                    contextlib.redirect_stdout(output):
                result = original_interactive(cfg)
        report_statistics(options.common.decoder_stats_json, sys.stdout)
        oversized.exit_if_refused()
        return result

    return interactive_main


def _live_lines(options, cfg, oversized):
    """For a streaming decoder (without lexical constraints): the input lines entering its stream as they arrive
    (``fairseq_fastgen/cli/live_lines.py``); None otherwise."""
    entry = DECODERS.get(str(options.common.decoder))
    if entry is None or entry.prepare_cli is not prepare_streaming_cli or cfg.generation.constraints:
        return None

    def go_live(arrivals, admitted, run_cfg):
        generator = generators_built[-1]
        device = "cuda" if torch.cuda.is_available() and not run_cfg.common.cpu else "cpu"  # as fairseq's use_cuda
        generator.live = LiveStream(generator, arrivals, admitted, getattr(run_cfg.task, "left_pad_source", True),
                                    device)

    return LiveLines(oversized.make_batches, cfg.interactive.buffer_size, go_live)


# ---- 6. numpy 2 -------------------------------------------------------------------------------
def _install_numpy_compat():
    import types

    import numpy

    if not hasattr(numpy, "compat"):
        numpy.compat = types.SimpleNamespace(long=numpy.int64)


# ---- 7. oneDNN's primitive cache --------------------------------------------------------------
ONEDNN_PRIMITIVE_CACHE = 32  # primitives oneDNN keeps; 8-32 measured alike, the default 1024 holds ~90 MiB more


def _cap_onednn_primitive_cache():
    """oneDNN reads its cache capacity once, at its first product: set before, unless the user set it."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))


# ---- 8. a data-bin without its dictionary ------------------------------------------------------
def _install_dictionary_loading():
    from fairseq.data import Dictionary

    original = Dictionary.add_from_file

    @functools.wraps(original)
    def add_from_file(self, f):
        try:
            return original(self, f)  # a path: opens it and calls itself again with the open file
        except FileNotFoundError as error:
            if not isinstance(f, str):
                raise
            raise UsageError(f"dictionary {f} does not exist: the data directory must hold the dictionaries "
                             f"fairseq-preprocess wrote for this model") from error

    Dictionary.add_from_file = add_from_file


# ---- 9. fairseq-train --cpu --amp ---------------------------------------------------------------
def _install_cpu_amp():
    original = FairseqTask.train_step

    @functools.wraps(original)
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        with training_precision(model, optimizer):
            return original(self, sample, model, criterion, optimizer, update_num, ignore_grad)

    FairseqTask.train_step = train_step
