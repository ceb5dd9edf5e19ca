"""fastgen-bench: every decoder measured side by side on one model and data-bin.

    fastgen-bench DATA --path CKPT --decoders beam,greedy --beam 1,5 --batch-size 1,64 --repeat 3

loads the model(s) once, collates the test sentences once per batching, and
runs every configuration (decoder x beam x batching) in this process: one
warm-up pass each (outputs, decoder statistics, peak memory), then ``--repeat``
rounds of timed passes, each round one pass of every configuration in turn.
``beam`` is fairseq's own SequenceGenerator; CTranslate2 joins when it is
installed and converts the checkpoint.  A configuration whose
decoder refuses the model or options (a ValueError from ``build_generator``
or ``generate``) is reported as skipped with the reason.

Writes a Markdown table to stdout and, to ``--output-dir``, ``results.json``,
``results.md``, ``bleu_vs_speed.png`` and ``hypotheses/LABEL.txt`` (each
configuration's detokenized best hypotheses, ``id<TAB>text`` by sentence id).
"""

import logging
import platform
import sys
from pathlib import Path
from typing import List, Optional

import torch
from tqdm import tqdm

import fairseq_fastgen
from fairseq_fastgen.bench import options, report, scoring
from fairseq_fastgen.bench.ctranslate2_peer import CTranslate2Peer
from fairseq_fastgen.bench.inputs import BenchInputs
from fairseq_fastgen.bench.measure import ConfigResult, FairseqCandidate, WarmRun, time_interleaved, warm_up
from fairseq_fastgen.bench.whole_process import ProcessPeer
from fairseq_fastgen.safe_files import write_atomically

logger = logging.getLogger("fastgen_bench")


def build_candidate(config, bench, run_cfg, inputs, peer):
    if isinstance(peer, ProcessPeer):
        return peer.candidate(config)
    if config.decoder == options.CTRANSLATE2:
        return peer.candidate(run_cfg.generation, config.beam)
    models = inputs.khead_models if options.decodes_with_khead(config, bench) else inputs.models
    generator = inputs.task.build_generator(models, run_cfg.generation)
    return FairseqCandidate(inputs.task, models, generator, run_cfg.generation.prefix_size)


def prepare_configuration(config, bench, inputs, peer, progress):
    """Build the configuration's decoder and run its warm-up pass; a WarmRun, or a skipped ConfigResult."""
    run_cfg = options.run_config(inputs.cfg, config, bench.cluster_projection, bench.variants,
                                 time_projection=options.projects_on_clusters(bench))
    try:
        candidate = build_candidate(config, bench, run_cfg, inputs, peer)
        batches = inputs.batches(run_cfg.dataset) if candidate.reads_batches else []
        result = warm_up(config, candidate, batches, inputs.use_cuda)
    except ValueError as error:
        logger.info("%s skipped: %s", config.label, error)
        progress.update(1 + bench.repeat)
        return ConfigResult(config, skipped=str(error))
    progress.update()
    return WarmRun(result, candidate, batches)


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
        peer, note = CTranslate2Peer.create(inputs)
        if note:
            notes.append(note)
    configs = options.configurations(bench, with_ctranslate2=isinstance(peer, CTranslate2Peer))
    prepared = []
    with tqdm(total=len(configs) * (1 + bench.repeat), unit="pass", file=sys.stderr,
              disable=cfg.common.no_progress_bar) as progress:
        for config in configs:
            progress.set_description(f"warm-up {config.label}")
            prepared.append(prepare_configuration(config, bench, inputs, peer, progress))
        progress.set_description("timed passes")
        time_interleaved([p for p in prepared if isinstance(p, WarmRun)], bench.repeat, inputs.use_cuda, progress)
    results = [p.result if isinstance(p, WarmRun) else p for p in prepared]
    scoring.score(results, inputs, bench.reference)
    if inputs.references is None:
        notes.append(f"subset {cfg.dataset.gen_subset!r} has no targets: no BLEU")
    return results, notes, inputs


def run_info(bench, cfg, inputs, notes, argv) -> dict:
    from fairseq import __version__ as fairseq_version

    return {
        "tool": "fastgen-bench",
        "fairseq_fastgen": fairseq_fastgen.__version__,
        "command": ["fastgen-bench"] + list(argv),
        "data": cfg.task.data,
        "path": cfg.common_eval.path,
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


def main(argv: List[str], log_to_stderr: bool = False) -> List[ConfigResult]:
    bench, cfg = options.parse_command_line(argv)
    if log_to_stderr:
        logging.basicConfig(  # force: hydra set the root logger to DEBUG while fairseq parsed the options
            format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, stream=sys.stderr,
            force=True,
        )
    results, notes, inputs = run_bench(bench, cfg)

    output_dir = Path(bench.output_dir)
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
    print(table)
    return results


def cli_main(argv: Optional[List[str]] = None):
    main(sys.argv[1:] if argv is None else argv, log_to_stderr=True)
