"""fastgen-bench: every decoder measured side by side on one model and data-bin.

    fastgen-bench DATA --path CKPT --decoders beam,greedy --beam 1,5 --batch-size 1,64 --repeat 3

loads the model(s) once, collates the test sentences once per batching, and
runs every configuration (decoder x beam x batching) in this process: one
warm-up pass each (outputs, decoder statistics, peak memory), then ``--repeat``
rounds of timed passes, each round one pass of every configuration in turn.
``beam`` is fairseq's own SequenceGenerator; CTranslate2 joins when it is
installed and converts the checkpoint.

Before any pass, every configuration's decoder is built in this process (also
for ``--whole-process`` runs): a misuse the plugin detects -- a decoder that
cannot run with this model or these options, a bad cluster file, a bad engine
option, a checkpoint that does not load -- ends the run with one
``fastgen-bench: error: ...`` line and exit status 2, as in fairseq-generate.
A configuration refused later, while decoding (a fairseq-generate process of a
``--whole-process`` run that fails, CTranslate2 declining a model), is reported
as skipped with the reason.  SIGTERM or SIGINT ends the run (and the
fairseq-generate process of a ``--whole-process`` pass) with one line on stderr
saying how many passes were run, and exit status 128 + the signal.

Writes a Markdown table to stdout and, to ``--output-dir``, ``results.json``,
``results.md``, ``bleu_vs_speed.png`` and ``hypotheses/LABEL.txt`` (each
configuration's detokenized best hypotheses, ``id<TAB>text`` by sentence id),
each written to a temporary name and renamed.

    fastgen-bench --plot-sizes sizes.png toy=bench/toy base=bench/base big=bench/big

measures nothing: it plots sentences/s against model size from the results.json
of runs already made, beside CTranslate2 (size_plot.py).

Where a configuration decodes with a cluster file, each configuration without
one is timed as it runs by default; its full projection is timed in one more,
untimed pass of its own (``--time-projection``, which takes the projection out
of the compiled engine's units), the baseline of the projection speedup.
"""

import contextlib
import logging
import platform
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch

import fairseq_fastgen
from fairseq_fastgen import checkpoint_safety
from fairseq_fastgen.bench import options, report, scoring, size_plot
from fairseq_fastgen.bench.ctranslate2_peer import CTranslate2Peer, shared_threads_note
from fairseq_fastgen.bench.inputs import BenchInputs
from fairseq_fastgen.bench.measure import (ConfigResult, FairseqCandidate, PassCounter, WarmRun, time_interleaved,
                                           warm_up)
from fairseq_fastgen.bench.whole_process import ProcessPeer
from fairseq_fastgen.integration import check_checkpoint_files
from fairseq_fastgen.option_checks import exit_on_usage_error, usage_errors
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.safe_files import write_atomically
from fairseq_fastgen.stop_signals import StopSignals, Stopped, exit_stopped

logger = logging.getLogger("fastgen_bench")


def build_candidate(config, bench, run_cfg, inputs, peer):
    """The configuration's candidate.  A plugin decoder's generator is built here, in this process, for a
    ``--whole-process`` run too, so that a misuse raises :class:`UsageError` before any pass runs."""
    if config.decoder == options.CTRANSLATE2:
        return peer.candidate(run_cfg.generation, config.beam)
    if config.decoder == options.STOCK_PROCESS:
        return peer.candidate(config)
    models = inputs.khead_models if options.decodes_with_khead(config, bench) else inputs.models
    generator = inputs.task.build_generator(models, run_cfg.generation)  # refuses a misuse
    if isinstance(peer, ProcessPeer):
        return peer.candidate(config, time_projection=bool(getattr(run_cfg.generation, "time_projection", False)))
    return FairseqCandidate(inputs.task, models, generator, run_cfg.generation.prefix_size)


class Prepared(NamedTuple):
    """A configuration ready for its warm-up: fairseq's config, its candidate, and the config of its projection
    timer (None where its full projection is not timed)."""

    run_cfg: object
    candidate: object
    timer_cfg: object = None


def prepare_candidate(config, bench, inputs, peer):
    """The configuration's :class:`Prepared`, or its skipped ConfigResult when a peer declines it; a misuse of
    the plugin raises :class:`UsageError`."""
    with usage_errors():  # a decoder's prepare_cli refuses its options too
        run_cfg = options.run_config(inputs.cfg, config, bench.cluster_projection, bench.variants)
        timer_cfg = None
        if options.times_projection_apart(config, bench):
            timer_cfg = options.run_config(inputs.cfg, config, bench.cluster_projection, bench.variants,
                                           time_projection=True)
    try:
        return Prepared(run_cfg, build_candidate(config, bench, run_cfg, inputs, peer), timer_cfg)
    except UsageError:
        raise
    except ValueError as error:  # CTranslate2 declines this model or these options
        logger.info("%s skipped: %s", config.label, error)
        return ConfigResult(config, skipped=str(error))


def warm_up_configuration(config, prepared: Prepared, bench, inputs, peer, progress):
    """The configuration's warm-up pass (and its projection timer's pass): a WarmRun, or a skipped ConfigResult
    when decoding refuses it."""
    progress.start(f"warm-up {config.label}")
    candidate = prepared.candidate
    try:
        batches = inputs.batches(prepared.run_cfg.dataset) if candidate.reads_batches else []
        result = warm_up(config, candidate, batches, inputs.use_cuda)
    except ValueError as error:  # e.g. the fairseq-generate process of a --whole-process pass failed
        logger.info("%s skipped: %s", config.label, error)
        progress.update(progress.passes_of(prepared))
        return ConfigResult(config, skipped=str(error))
    progress.update()
    if prepared.timer_cfg is not None:
        progress.start(f"projection timing {config.label}")
        result.statistics.update(time_full_projection(config, prepared.timer_cfg, bench, inputs, peer, batches))
        progress.update()
    return WarmRun(result, candidate, batches)


def time_full_projection(config, timer_cfg, bench, inputs, peer, batches) -> dict:
    """The ``projection_*`` statistics of one untimed pass of ``config`` with ``--time-projection``: the baseline
    of the projection speedup, timed apart so that the configuration's own passes run as a user runs them."""
    try:
        timer = build_candidate(config, bench, timer_cfg, inputs, peer)
        timer.decode(batches)
    except ValueError as error:  # UsageError included: the baseline is then reported without a projection time
        logger.info("%s: its full projection was not timed: %s", config.label, error)
        return {}
    return {name: value for name, value in timer.statistics().items() if name.startswith("projection_")}


def run_bench(bench, cfg):
    """Measure every configuration; returns (results, notes, inputs)."""
    threads_before = torch.get_num_threads()
    if bench.threads is not None:
        torch.set_num_threads(bench.threads)
    try:
        return measure_all(bench, cfg)
    finally:
        torch.set_num_threads(threads_before)  # callers in the same process keep their setting


def measure_all(bench, cfg):
    inputs = BenchInputs(cfg, bench.khead_path, bench.max_sentences)
    notes = []
    peer = None
    if bench.whole_process:
        peer = ProcessPeer(bench)
        notes.append("whole fairseq-generate processes: each pass is one process, start-up to exit; "
                     "CTranslate2 is measured only in in-process runs")
    elif not bench.no_ctranslate2:
        peer, note = CTranslate2Peer.create(inputs, bench.ctranslate2_compute_type)
        if note:
            notes.append(note)
        note = shared_threads_note(torch.get_num_threads(), inputs.use_cuda) if peer is not None else None
        if note:
            notes.append(note)
    configs = options.configurations(bench, with_ctranslate2=isinstance(peer, CTranslate2Peer))
    candidates = [prepare_candidate(config, bench, inputs, peer) for config in configs]  # every misuse refused here
    prepared = []
    with PassCounter(candidates, bench.repeat, disable=cfg.common.no_progress_bar) as progress:
        try:
            for config, candidate in zip(configs, candidates):
                if isinstance(candidate, ConfigResult):
                    progress.update(progress.passes_of(candidate))
                    prepared.append(candidate)
                else:
                    prepared.append(warm_up_configuration(config, candidate, bench, inputs, peer, progress))
            progress.start("timed passes")
            time_interleaved([p for p in prepared if isinstance(p, WarmRun)], bench.repeat, inputs.use_cuda, progress)
        except Stopped as stop:
            raise Stopped(stop.signum, finished=f"{progress.report()}; no results were written") from None
    results = [p.result if isinstance(p, WarmRun) else p for p in prepared]
    scoring.score(results, inputs, bench.reference)
    if inputs.references is None:
        notes.append(f"subset {cfg.dataset.gen_subset!r} has no targets: no BLEU")
    return results, notes, inputs


def model_shape(models) -> dict:
    """The parameters of the models (an ensemble's together), and the first one's layers and width where it has
    fairseq's transformer attributes (the x labels of ``--plot-sizes``)."""
    model = models[0]
    encoder, decoder = getattr(model, "encoder", None), getattr(model, "decoder", None)
    embed_tokens = getattr(encoder, "embed_tokens", None)
    return {
        "parameters": sum(p.numel() for m in models for p in m.parameters()),
        "encoder_layers": len(encoder.layers) if hasattr(encoder, "layers") else None,
        "decoder_layers": len(decoder.layers) if hasattr(decoder, "layers") else None,
        "width": getattr(embed_tokens, "embedding_dim", None),
    }


def run_info(bench, cfg, inputs, notes, argv) -> dict:
    from fairseq import __version__ as fairseq_version

    return {
        "tool": "fastgen-bench",
        "fairseq_fastgen": fairseq_fastgen.__version__,
        "command": ["fastgen-bench"] + list(argv),
        "data": cfg.task.data,
        "path": cfg.common_eval.path,
        "model": model_shape(inputs.models),
        "khead_path": bench.khead_path,
        "cluster_projection": bench.cluster_projection,
        "subset": cfg.dataset.gen_subset,
        "sentences": len(inputs.sentence_ids),
        "repeat": bench.repeat,
        "reference": bench.reference,
        "device": torch.cuda.get_device_name() if inputs.use_cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch_threads": bench.threads or torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "fairseq": fairseq_version},
        "notes": notes,
    }


def check_checkpoints(bench, cfg):
    """--path and --khead-path name checkpoints that exist and can be read (else one error line, exit 2)."""
    check_checkpoint_files(cfg)
    if bench.khead_path is not None:
        checkpoint_safety.check_readable(bench.khead_path)


def write_results(output_dir: Path, bench, cfg, results, notes, inputs, argv) -> str:
    """Every file of ``output_dir``, each written to a temporary name and renamed; returns the Markdown table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    info = run_info(bench, cfg, inputs, notes, argv)
    hypotheses = report.write_hypotheses(output_dir, results, inputs.detokenize)
    title = f"{Path(cfg.common_eval.path).name} on {cfg.dataset.gen_subset} ({info['sentences']} sentences, {info['device']})"
    plot = report.plot_bleu_against_speed(output_dir / report.PLOT_FILE, results, title)
    info["plots"] = [str(plot)] if plot else []
    report.write_json(output_dir / "results.json", results, info, hypotheses)
    table = report.markdown_table(results) + "\n"
    projections = report.projection_table(results)
    if projections:
        table += "\nVocabulary projection against the reference configuration:\n\n" + projections + "\n"
    table += "".join(f"\nNote: {note}" for note in notes)
    write_atomically(output_dir / "results.md", lambda f: f.write((table + "\n").encode()))
    return table


@exit_on_usage_error("fastgen-bench")
def main(argv: List[str], log_to_stderr: bool = False, signals: Optional[StopSignals] = None) -> List[ConfigResult]:
    """The bench; ``signals``: the :class:`StopSignals` of the command line, which holds a stop while the results
    are written, so that they are written together."""
    bench, cfg = options.parse_command_line(argv)
    if log_to_stderr:
        logging.basicConfig(  # force: hydra set the root logger to DEBUG when fairseq was imported
            format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, stream=sys.stderr,
            force=True,
        )
    if bench.plot_sizes is not None:  # a plot of runs already made: nothing measured
        print(size_plot.plot_sizes(bench.plot_sizes[0], bench.plot_sizes[1:]))
        return []
    check_checkpoints(bench, cfg)
    results, notes, inputs = run_bench(bench, cfg)
    output_dir = Path(bench.output_dir)
    try:
        with signals.held() if signals else contextlib.nullcontext():
            table = write_results(output_dir, bench, cfg, results, notes, inputs, argv)
    except Stopped as stop:
        raise Stopped(stop.signum, finished=f"every pass was run, and the results were written to {output_dir}") \
            from None
    print(table)
    return results


def cli_main(argv: Optional[List[str]] = None):
    with StopSignals() as signals:
        try:
            main(sys.argv[1:] if argv is None else argv, log_to_stderr=True, signals=signals)
        except Stopped as stop:
            exit_stopped("fastgen-bench", stop, stop.finished or "no pass was run; no results were written")
