"""fairseq-generate with post-processing in worker processes (``--postprocess-workers N``).

The main process decodes batch after batch.  Each decoded batch goes to one of
N worker processes, which turns it into the lines fairseq-generate prints (S, T,
H, D, P and, when asked, A, I, E) -- BPE removal (``--post-process``),
detokenization (``--tokenizer``, ``--bpe``), unknown-word replacement, score
formatting -- and into the scorer's input, while the next batches decode.
Between batches the main process prints the finished batches in decoding
order and feeds the BLEU scorer.  The lines, their order and the final
"Generate ... with beam=..." line are those of stock fairseq-generate
(``fairseq_cli.generate._main``): the workers call the same fairseq functions
on the same values; only where they run changes.

Errors: a batch is printed whole or not at all.  When post-processing fails,
the main process raises it with the worker's traceback and fairseq-generate
exits non-zero: a run never ends normally with lines missing.  A worker that
dies (killed, crashed) is found at the next batch, or when the run ends, even
when the other workers printed every line: the run then ends the other
workers, says on stderr which worker died and how many sentences were
written, and exits with status 1.  SIGTERM or SIGINT to fairseq-generate ends
every worker (:mod:`fairseq_fastgen.stop_signals`), writes no partial batch,
says how many sentences were written and how many were not, and exits with
status 128 + the signal's number.  A worker whose parent is gone (killed with
SIGKILL) exits by itself.

Why processes and not threads: post-processing is Python code that holds the
GIL, and so is much of beam search.  Worker threads made decoding slower than
no workers at all: every torch call releases and retakes the GIL, and each
retake waited behind a busy worker.  The workers are forked before
any model is loaded, so they inherit the dictionaries, tokenizer and BPE
without starting Python again, and no thread pool of torch; they receive each
batch's tokens and scores as numpy arrays (Linux and macOS; fork is needed).
"""

import ast
import logging
import math
import multiprocessing
import os
import queue
import signal
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch
from fairseq import checkpoint_utils, scoring, tasks, utils
from fairseq.logging import progress_bar
from fairseq.logging.meters import StopwatchMeter, TimeMeter
from fairseq_cli.generate import get_symbols_to_strip_from_output

from fairseq_fastgen.cli.batched_output import WrittenTally
from fairseq_fastgen.stop_signals import StopSignals, Stopped, exit_stopped, ignore_in_worker
from fairseq_fastgen.text_codec import decode_text

logger = logging.getLogger("fairseq_cli.generate")

PENDING_BATCHES_PER_WORKER = 2  # decoded batches waiting for a worker, at most, per worker
HYPOTHESIS_FIELDS = ("tokens", "score", "positional_scores", "alignment", "steps", "history")  # what is printed
LIVENESS_CHECK_S = 1.0  # how often a waiting main process checks that its workers are alive


def async_generate_main(cfg, output_file, workers: int):
    """fairseq-generate's ``_main(cfg, output_file)`` with post-processing in ``workers`` workers
    (``--postprocess-workers``); returns the scorer."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=output_file,
    )
    utils.import_user_module(cfg.common)
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = 12000
    logger.info(cfg)
    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)

    task = tasks.setup_task(cfg.task)
    formatter = BatchFormatter.for_task(cfg, task)
    tally = WrittenTally()
    try:
        with StopSignals() as signals, WorkerPool(workers, formatter) as pool:  # forks now
            scorer, gen_timer, num_sentences, has_target = _generate(cfg, task, pool, output_file, signals, tally)
    except (Stopped, WorkerDied) as stop:
        output_file.flush()
        exit_stopped("fairseq-generate", stop, tally.summary())

    logger.info("NOTE: hypothesis and token scores are output in base 2")
    logger.info(
        "Translated {:,} sentences ({:,} tokens) in {:.1f}s ({:.2f} sentences/s, {:.2f} tokens/s)".format(
            num_sentences, gen_timer.n, gen_timer.sum, num_sentences / gen_timer.sum, 1.0 / gen_timer.avg
        )
    )
    if has_target:
        _warn_about_bpe_bleu(cfg)
        output_file.write(
            "Generate {} with beam={}: {}\n".format(cfg.dataset.gen_subset, cfg.generation.beam, scorer.result_string())
        )
    return scorer


def _generate(cfg, task, pool, output_file, signals, tally):
    """The decoding loop; returns the scorer, the timer, the number of sentences and whether they had targets."""
    run = GenerationRun.load(cfg, task)
    tally.total = len(run.dataset)
    scorer = scoring.build_scorer(cfg.scoring, run.tgt_dict)
    writer = OrderedWriter(output_file, scorer, run.tgt_dict, signals, tally)
    gen_timer, wps_meter = StopwatchMeter(), TimeMeter()
    num_sentences = 0
    for sample in run.progress:
        sample = utils.move_to_cuda(sample) if run.use_cuda else sample
        if "net_input" not in sample:
            continue
        gen_timer.start()
        hypos = task.inference_step(
            run.generator,
            run.models,
            sample,
            prefix_tokens=_prefix_tokens(cfg, sample),
            constraints=sample.get("constraints"),
        )
        num_generated_tokens = sum(len(h[0]["tokens"]) for h in hypos)
        gen_timer.stop(num_generated_tokens)
        pool.submit(DecodedBatch.of(sample, hypos, cfg, run, pool.formatter.align_dict is not None))
        writer.write_ready(pool.finished())
        wps_meter.update(num_generated_tokens)
        run.progress.log({"wps": round(wps_meter.avg)})
        num_sentences += sample["nsentences"] if "nsentences" in sample else sample["id"].numel()
    writer.write_ready(pool.wait_all())
    return scorer, gen_timer, num_sentences, writer.has_target


def _prefix_tokens(cfg, sample):
    if cfg.generation.prefix_size > 0:
        return sample["target"][:, : cfg.generation.prefix_size]
    return None


def _warn_about_bpe_bleu(cfg):
    if not cfg.bpe or cfg.generation.sacrebleu:
        return
    if cfg.common_eval.post_process:
        logger.warning(
            "BLEU score is being computed by splitting detokenized string on spaces, this is probably not what "
            "you want. Use --sacrebleu for standard 13a BLEU tokenization"
        )
    else:
        logger.warning(
            "If you are using BPE on the target side, the BLEU score is computed on BPE tokens, not on proper "
            "words.  Use --sacrebleu for standard 13a BLEU tokenization"
        )


@dataclass
class GenerationRun:
    """What fairseq-generate loads before its loop: models, generator, batches."""

    models: list
    generator: object
    progress: object  # the batch iterator, wrapped in fairseq's progress bar
    dataset: object  # the split being translated
    tgt_dict: object
    use_cuda: bool

    @classmethod
    def load(cls, cfg, task):
        use_cuda = torch.cuda.is_available() and not cfg.common.cpu
        overrides = ast.literal_eval(cfg.common_eval.model_overrides)
        logger.info("loading model(s) from {}".format(cfg.common_eval.path))
        models, saved_cfg = checkpoint_utils.load_model_ensemble(
            utils.split_paths(cfg.common_eval.path),
            arg_overrides=overrides,
            task=task,
            suffix=cfg.checkpoint.checkpoint_suffix,
            strict=(cfg.checkpoint.checkpoint_shard_count == 1),
            num_shards=cfg.checkpoint.checkpoint_shard_count,
        )
        task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)
        language_model = _load_language_model(cfg, overrides)
        for model in models + ([language_model] if language_model is not None else []):
            if cfg.common.fp16:
                model.half()
            if use_cuda and not cfg.distributed_training.pipeline_model_parallel:
                model.cuda()
            model.prepare_for_inference_(cfg)
        batches = task.get_batch_iterator(
            dataset=task.dataset(cfg.dataset.gen_subset),
            max_tokens=cfg.dataset.max_tokens,
            max_sentences=cfg.dataset.batch_size,
            max_positions=utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models]),
            ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
            seed=cfg.common.seed,
            num_shards=cfg.distributed_training.distributed_world_size,
            shard_id=cfg.distributed_training.distributed_rank,
            num_workers=cfg.dataset.num_workers,
            data_buffer_size=cfg.dataset.data_buffer_size,
        ).next_epoch_itr(shuffle=False)
        progress = progress_bar.progress_bar(
            batches,
            log_format=cfg.common.log_format,
            log_interval=cfg.common.log_interval,
            default_log_format=("tqdm" if not cfg.common.no_progress_bar else "simple"),
        )
        generator = task.build_generator(
            models,
            cfg.generation,
            extra_gen_cls_kwargs={"lm_model": language_model, "lm_weight": cfg.generation.lm_weight},
        )
        return cls(models, generator, progress, task.dataset(cfg.dataset.gen_subset), task.target_dictionary, use_cuda)


def _load_language_model(cfg, overrides):
    """The ``--lm-path`` model for shallow fusion, or None."""
    if cfg.generation.lm_path is None:
        return None
    lm_overrides = dict(overrides, data=cfg.task.data)
    language_models, _ = checkpoint_utils.load_model_ensemble([cfg.generation.lm_path], arg_overrides=lm_overrides, task=None)
    if len(language_models) != 1:
        raise ValueError(f"--lm-path must name one model, got {len(language_models)}")
    return language_models[0]


def _to_numpy(value):
    """Tensors (nested in lists, tuples, dicts) as numpy arrays, to cross a process boundary."""
    if torch.is_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_numpy(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_numpy(item) for key, item in value.items()}
    return value


def _to_torch(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_torch(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_torch(item) for key, item in value.items()}
    return value


@dataclass
class DecodedBatch:
    """What a worker needs to print a batch, as numpy arrays and plain values."""

    ids: List[int]
    src_tokens: Optional[np.ndarray]  # (sentences, src_len), padded
    target: Optional[np.ndarray]  # (sentences, tgt_len), padded
    hypos: list  # per sentence, its n best hypotheses: dicts of HYPOTHESIS_FIELDS
    symbols_to_strip: set
    original_texts: Optional[List[tuple]]  # per sentence (source, target) raw text, for --replace-unk
    index: int = -1  # position in decoding order, set by WorkerPool.submit

    @classmethod
    def of(cls, sample, hypos, cfg, run, with_original_text):
        ids = sample["id"].tolist()
        nbest = cfg.generation.nbest
        kept = [[{k: h[k] for k in HYPOTHESIS_FIELDS if k in h} for h in sentence[:nbest]] for sentence in hypos]
        original_texts = None
        if with_original_text:
            original_texts = [(run.dataset.src.get_original_text(i), run.dataset.tgt.get_original_text(i)) for i in ids]
        net_input = sample["net_input"]
        return cls(
            ids,
            _to_numpy(net_input["src_tokens"]) if "src_tokens" in net_input else None,
            _to_numpy(sample["target"]),
            _to_numpy(kept),
            set(get_symbols_to_strip_from_output(run.generator)),
            original_texts,
        )


@dataclass
class ScoreInput:
    """What the scorer gets for one sentence's top hypothesis."""

    target_str: str
    hypo_str: str  # detokenized
    # int32 ids; None after BPE removal or unk replacement: the main process then encodes the strings
    target_tokens: Optional[np.ndarray]
    hypo_tokens: Optional[np.ndarray]


@dataclass
class BatchOutput:
    index: int
    text: str  # every line printed for the batch, in order
    score_inputs: List[ScoreInput] = field(default_factory=list)
    has_target: Optional[bool] = None  # whether the batch's last sentence had a target; None: no sentence
    sentences: int = 0


class BatchFormatter:
    """Turns a decoded batch into fairseq-generate's lines and scorer input; runs in the workers."""

    def __init__(self, cfg, src_dict, tgt_dict, tokenizer, bpe, align_dict):
        self.gen_cfg, self.eval_cfg = cfg.generation, cfg.common_eval
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.tokenizer, self.bpe, self.align_dict = tokenizer, bpe, align_dict
        # fairseq re-encodes the strings for scoring after unk replacement or BPE removal
        self.rescore_tokens = align_dict is not None or self.eval_cfg.post_process is not None

    @classmethod
    def for_task(cls, cfg, task):
        return cls(
            cfg,
            getattr(task, "source_dictionary", None),
            task.target_dictionary,
            task.build_tokenizer(cfg.tokenizer),
            task.build_bpe(cfg.bpe),
            utils.load_align_dict(cfg.generation.replace_unk),
        )

    def decode(self, text):
        return decode_text(text, self.tokenizer, self.bpe)

    def format_batch(self, batch: DecodedBatch) -> BatchOutput:
        output = BatchOutput(batch.index, text="", sentences=len(batch.ids))
        src_tokens, target, hypos = _to_torch(batch.src_tokens), _to_torch(batch.target), _to_torch(batch.hypos)
        lines = []
        for row, sample_id in enumerate(batch.ids):
            output.has_target = target is not None
            original = batch.original_texts[row] if batch.original_texts is not None else None
            score_input = self._format_sentence(
                sample_id, src_tokens, target, row, hypos[row], batch.symbols_to_strip, original, lines
            )
            if score_input is not None:
                output.score_inputs.append(score_input)
        output.text = "".join(line + "\n" for line in lines)
        return output

    def _format_sentence(self, sample_id, src_tokens, target, row, hypos, symbols_to_strip, original, lines):
        quiet = self.eval_cfg.quiet
        src_str, target_str, target_tokens = self._source_and_target(src_tokens, target, row, symbols_to_strip, original)
        has_target = target_tokens is not None
        if not quiet:
            if self.src_dict is not None:
                lines.append(f"S-{sample_id}\t{src_str}")
            if has_target:
                lines.append(f"T-{sample_id}\t{target_str}")
        score_input = None
        for rank, hypo in enumerate(hypos):
            hypo_tokens, hypo_str, alignment = utils.post_process_prediction(
                hypo_tokens=hypo["tokens"].int().cpu(),
                src_str=src_str,
                alignment=hypo["alignment"],
                align_dict=self.align_dict,
                tgt_dict=self.tgt_dict,
                remove_bpe=self.eval_cfg.post_process,
                extra_symbols_to_ignore=symbols_to_strip,
            )
            detok_hypo_str = self.decode(hypo_str)
            if not quiet:
                lines.extend(self._hypothesis_lines(sample_id, hypo, hypo_str, detok_hypo_str, alignment, src_str))
            if has_target and rank == 0:
                score_input = self._score_input(target_str, target_tokens, detok_hypo_str, hypo_tokens)
        return score_input

    def _source_and_target(self, src_tokens, target, row, symbols_to_strip, original):
        """(source string, target string, target tokens); the target ones None without a target."""
        target_tokens = None
        if target is not None:
            target_tokens = utils.strip_pad(target[row, :], self.tgt_dict.pad()).int().cpu()
        if original is not None:
            src_str, target_str = original
        else:
            src_str = ""
            if self.src_dict is not None and src_tokens is not None:
                src_str = self.src_dict.string(utils.strip_pad(src_tokens[row, :], self.tgt_dict.pad()),
                                               self.eval_cfg.post_process)
            target_str = None
            if target_tokens is not None:
                target_str = self.tgt_dict.string(
                    target_tokens,
                    self.eval_cfg.post_process,
                    escape_unk=True,
                    extra_symbols_to_ignore=symbols_to_strip,
                )
        src_str = self.decode(src_str)
        if target_tokens is not None:
            target_str = self.decode(target_str)
        return src_str, target_str, target_tokens

    def _score_input(self, target_str, target_tokens, detok_hypo_str, hypo_tokens):
        if self.rescore_tokens:
            # fairseq re-encodes the strings, adding unseen words to the dictionary in sentence order;
            # its BLEU hashes n-grams of those ids, so only the main process, in that order, gives its ids
            return ScoreInput(target_str, detok_hypo_str, None, None)
        return ScoreInput(target_str, detok_hypo_str, target_tokens.numpy(), hypo_tokens.numpy())

    def _hypothesis_lines(self, sample_id, hypo, hypo_str, detok_hypo_str, alignment, src_str):
        score = hypo["score"] / math.log(2)  # base 2, formatted as fairseq formats the 0-d tensor
        positional = hypo["positional_scores"].div_(math.log(2)).tolist()
        yield f"H-{sample_id}\t{score}\t{hypo_str}"
        yield f"D-{sample_id}\t{score}\t{detok_hypo_str}"
        yield f"P-{sample_id}\t" + " ".join(f"{value:.4f}" for value in positional)
        if self.gen_cfg.print_alignment == "hard":
            yield f"A-{sample_id}\t" + " ".join(f"{src_idx}-{tgt_idx}" for src_idx, tgt_idx in alignment)
        if self.gen_cfg.print_alignment == "soft":
            yield f"A-{sample_id}\t" + " ".join(",".join(src_probs) for src_probs in alignment)
        if self.gen_cfg.print_step:
            yield f"I-{sample_id}\t{hypo['steps']}"
        if self.gen_cfg.retain_iter_history:
            for step, past in enumerate(hypo["history"]):
                _, past_str, _ = utils.post_process_prediction(
                    hypo_tokens=past["tokens"].int().cpu(),
                    src_str=src_str,
                    alignment=None,
                    align_dict=None,
                    tgt_dict=self.tgt_dict,
                    remove_bpe=None,
                )
                yield f"E-{sample_id}_{step}\t{past_str}"


class PostProcessingError(RuntimeError):
    """A worker failed to post-process a batch; the message holds the worker's traceback."""


class WorkerDied(PostProcessingError):
    """A worker process ended without being asked to (killed, crashed)."""

    exit_status = 1

    def __init__(self, process):
        code = process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        super().__init__(f"post-processing worker {process.name} (pid {process.pid}) died ({how})")


class WorkerPool:
    """``formatter.format_batch`` in ``workers`` forked processes; results come back in any order.

    Use as a context manager, created before any model is loaded: leaving it
    stops the workers (after the results are read, or at once on an error), and
    raises :class:`WorkerDied` if one of them ended otherwise than asked.
    """

    def __init__(self, workers: int, formatter: BatchFormatter):
        if workers < 1:
            raise ValueError(f"--postprocess-workers must be positive here, got {workers}")
        self.formatter = formatter
        context = multiprocessing.get_context("fork")
        self.jobs = context.Queue(maxsize=PENDING_BATCHES_PER_WORKER * workers)
        self.results = context.Queue()
        self.processes = [
            context.Process(target=_work, args=(formatter, self.jobs, self.results, os.getpid()),
                            name=f"postprocess-{n}", daemon=True)
            for n in range(workers)
        ]
        for process in self.processes:
            process.start()
        self.submitted = 0
        self.received = 0

    def submit(self, batch: DecodedBatch):
        """Hand a batch to the workers; waits while too many batches wait."""
        self._check_alive()  # a death is reported at the next batch, even when the others keep up
        batch.index = self.submitted
        while True:
            try:
                self.jobs.put(batch, timeout=LIVENESS_CHECK_S)
                break
            except queue.Full:
                self._check_alive()
        self.submitted += 1

    def finished(self) -> List[BatchOutput]:
        """The batches finished since the last call, without waiting."""
        outputs = []
        while True:
            try:
                outputs.append(self._receive(self.results.get_nowait()))
            except queue.Empty:
                return outputs

    def wait_all(self) -> List[BatchOutput]:
        """Every batch not yet returned, waiting for them."""
        outputs = []
        while self.received < self.submitted:
            try:
                outputs.append(self._receive(self.results.get(timeout=LIVENESS_CHECK_S)))
            except queue.Empty:
                self._check_alive()
        return outputs

    def _receive(self, result):
        self.received += 1
        output, error = result
        if error is not None:
            raise PostProcessingError(f"post-processing failed in a worker:\n{error}")
        return output

    def _check_alive(self):
        """While batches may come: a worker that has ended has died."""
        for process in self.processes:
            if process.exitcode is not None:
                raise WorkerDied(process)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self._terminate()
            return False
        try:
            self._stop_when_idle()
        except BaseException:
            self._terminate()
            raise
        return False

    def _stop_when_idle(self):
        """Ask every worker to stop and wait for them; a worker that died meanwhile, or before, is raised."""
        self._check_alive()
        for _ in self.processes:
            self.jobs.put(None)
        for process in self.processes:
            while process.exitcode is None:  # a dead worker may hold the queue's lock: do not wait blindly
                process.join(LIVENESS_CHECK_S)
                self._check_exit_codes()
        self._check_exit_codes()

    def _check_exit_codes(self):
        for process in self.processes:
            if process.exitcode not in (None, 0):
                raise WorkerDied(process)

    def _terminate(self):
        self.jobs.cancel_join_thread()  # batches no worker will read must not hold up the exit
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join()


def _work(formatter: BatchFormatter, jobs, results, parent: int):
    """A worker's loop: format batches until it gets None, or its parent is gone."""
    ignore_in_worker()
    torch.set_num_threads(1)
    while True:
        try:
            batch = jobs.get(timeout=LIVENESS_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the main process was killed without stopping us
            continue
        if batch is None:
            return
        try:
            results.put((formatter.format_batch(batch), None))
        except Exception:  # noqa: BLE001  (any failure goes back to the main process, which raises it)
            results.put((None, traceback.format_exc()))


class OrderedWriter:
    """Prints batches and feeds the scorer in decoding order (in the main process)."""

    def __init__(self, output_file, scorer, tgt_dict, signals=None, tally=None):
        self.output_file, self.scorer, self.tgt_dict = output_file, scorer, tgt_dict
        self.signals = signals or StopSignals()  # a signal waits until the batch being written is written
        self.tally = tally or WrittenTally()
        self.has_target = True  # as fairseq: the last sentence's, True when none was decoded
        self.next_index = 0
        self.waiting: Dict[int, BatchOutput] = {}  # finished out of order

    def write_ready(self, outputs: List[BatchOutput]):
        for output in outputs:
            self.waiting[output.index] = output
        while self.next_index in self.waiting:
            with self.signals.held():
                batch = self.waiting.pop(self.next_index)
                self._write(batch)
                self.next_index += 1
                self.tally.written += batch.sentences

    def _write(self, batch: BatchOutput):
        self.output_file.write(batch.text)
        if batch.has_target is not None:
            self.has_target = batch.has_target
        for item in batch.score_inputs:
            if hasattr(self.scorer, "add_string"):
                self.scorer.add_string(item.target_str, item.hypo_str)
            elif item.target_tokens is None:  # as fairseq-generate: target first, new words added in order
                target_tokens = self.tgt_dict.encode_line(item.target_str, add_if_not_exist=True)
                hypo_tokens = self.tgt_dict.encode_line(item.hypo_str, add_if_not_exist=True)
                self.scorer.add(target_tokens, hypo_tokens)
            else:
                self.scorer.add(torch.from_numpy(item.target_tokens), torch.from_numpy(item.hypo_tokens))
