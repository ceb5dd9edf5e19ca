"""``fastgen-distill``: a teacher's translations as a new data-bin.

    fastgen-distill DATA --path TEACHER.pt --split train --output-dir OUT [generation options]

translates every source sentence of one split of the data-bin DATA with the
teacher (stock beam search by default; any ``--decoder`` of the plugin and any
generation option, read exactly as fairseq-generate reads them) and writes the
data-bin OUT, ready for ``fairseq-train`` (task ``translation`` on OUT, or
``translation_distill`` with ``--distilled-data OUT``):

* ``OUT/dict.SRC.txt``, ``OUT/dict.TGT.txt``: DATA's dictionaries, copied;
* ``OUT/SPLIT.SRC-TGT.SRC.{bin,idx}``: the split's source side, copied;
* ``OUT/SPLIT.SRC-TGT.TGT.{bin,idx}``: the teacher's best hypothesis for every
  sentence, in the original order and in the dataset format of the source;
* the other splits of DATA, copied (original targets) when OUT lacks them;
* ``OUT/distill.SPLIT.json``: counts, timings, settings and the teacher's BLEU.

Shards
    The split is cut into shards of consecutive sentence ids (``--num-shards``;
    0, the default, makes one per 1000 sentences).  A shard is decoded by one
    worker in batches formed inside the shard with fairseq's length-sorted
    batching and ``--seed``, and the torch seed is reset per shard, so its
    output does not depend on which worker, or how many, decoded it.  A
    finished shard goes to a temporary file that is then renamed into
    ``OUT/distill-shards/SPLIT/`` (atomic): a killed run leaves only whole
    shards, and the same command run again decodes only the missing ones.
    ``run.json`` beside them records the settings; a resumed run with other
    settings is refused.  A resumed run reads every shard it keeps and checks
    that it holds its sentences exactly once before decoding the others; a
    damaged shard is named in the error.

Files
    Every file of OUT is written to a temporary name and renamed
    (:mod:`fairseq_fastgen.safe_files`), so a kill leaves no partial file, and
    recorded with its size and SHA-256 in ``OUT/distill-files.json``.  The
    split's files are written again by every run; the other splits' files that
    OUT already holds are kept only when they are what was recorded (a damaged
    copy of DATA's file is copied again, a damaged distilled split is refused
    by name), or, when not recorded, when they are DATA's file byte for byte.

Workers
    ``--workers N`` starts N processes on this machine; under ``torchrun
    --nproc_per_node N -m fairseq_fastgen.distill ...`` each rank is a worker
    (gloo, for two barriers).  Worker i uses GPU i on a GPU machine.  SIGTERM
    or SIGINT to fastgen-distill ends its workers, says how many shards are
    done (kept for the next run) and exits with status 128 + the signal.  A worker
    takes a shard by creating its claim file exclusively, so a faster worker
    simply takes more shards; claims left by a killed run are dropped when the
    next run starts.  When all shards are done one process merges them in
    sentence order, checks that every sentence has exactly one target, and only
    then writes the data-bin.  Outputs are identical for any number of workers
    when every worker runs with the same number of CPU threads
    (``OMP_NUM_THREADS``) or on the same kind of GPU.

Refusals and reports
    A teacher whose dictionaries differ from DATA's is refused, naming the
    first differing symbol (the teacher's dictionaries are read from the data
    directory its checkpoint records, or ``--teacher-data``).  An empty split
    is refused.  Sources longer than the teacher's maximum source positions are
    truncated (first positions - 1 tokens, then the final eos), counted and
    reported; their full source is still what OUT holds.
"""

import ast
import filecmp
import gc
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import sacrebleu
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

import fairseq_fastgen  # noqa: F401  (plugin: --decoder and its options, checkpoint allow-list)
from fairseq import checkpoint_utils, options, tasks, utils
from fairseq.data import data_utils, indexed_dataset
from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import convert_namespace_to_omegaconf, gen_parser_from_dataclass
from fairseq_fastgen import checkpoint_safety
from fairseq_fastgen.option_checks import exit_on_usage_error
from fairseq_fastgen.option_checks import UsageError, check_generation_options, require_int
from fairseq_fastgen.options import parse_options
from fairseq_fastgen.safe_files import (FileManifest, copy_atomically, remove_stale_temporaries, write_atomically,
                                        write_step)
from fairseq_fastgen.stop_signals import StopSignals, Stopped
from fairseq_fastgen.tasks.translation_distill import check_same_dictionaries

logger = logging.getLogger("fairseq_fastgen.distill")

SENTENCES_PER_SHARD = 1000  # shard size when --num-shards is 0
DEFAULT_MAX_TOKENS = 12000  # fairseq-generate's batch size when neither --max-tokens nor --batch-size is given
SHARDS_DIR = "distill-shards"
MANIFEST = "distill-files.json"  # in OUT: size, SHA-256 and origin of every file written there
# for tests: a worker exits abruptly (no merge) after finishing this many shards, as if killed
STOP_AFTER_SHARDS_ENV = "FASTGEN_DISTILL_STOP_AFTER_SHARDS"
INTERRUPTED_EXIT_CODE = 75


class DistillError(Exception):
    """A refusal explained to the user (printed without a traceback, exit status 1). A misuse of the command
    line is a :class:`UsageError` instead (one ``fastgen-distill: error:`` line, exit status 2)."""


@dataclass
class DistillOptions(FairseqDataclass):
    output_dir: Optional[str] = field(
        default=None,
        metadata={"help": "directory of the distilled data-bin (required); running the same command "
                          "again resumes an interrupted run from its finished shards"},
    )
    workers: int = field(
        default=1,
        metadata={"help": "worker processes started on this machine (one per GPU on a GPU machine); "
                          "under torchrun leave it at 1: every rank is a worker"},
    )
    teacher_data: Optional[str] = field(
        default=None,
        metadata={"help": "data-bin whose dictionaries the teacher was trained with, checked against DATA's "
                          "(default: the data directory recorded in the teacher's checkpoint)"},
    )


# ---- options ---------------------------------------------------------------------------------
def build_parser():
    parser = options.get_generation_parser(default_task="translation")
    parser.prog = "fastgen-distill"
    parser.description = (
        "Translate every source sentence of a split of DATA with a teacher and write a data-bin whose "
        "targets are the teacher's outputs. --split is --gen-subset (default: train); --num-shards cuts "
        f"the split into that many resumable shards (0: one per {SENTENCES_PER_SHARD} sentences)."
    )
    parser.set_defaults(gen_subset="train", num_shards=0)
    group = parser.add_argument_group("fastgen-distill")
    gen_parser_from_dataclass(group, DistillOptions())
    group.add_argument("--split", dest="gen_subset", metavar="SPLIT",
                       help="split of DATA to distill (same as --gen-subset; default: train)")
    return parser


def parse(argv):
    args = options.parse_args_and_arch(build_parser(), input_args=argv)
    if not args.output_dir:
        raise UsageError("--output-dir is required")
    if not args.path:
        raise UsageError("--path TEACHER is required")
    if args.prefix_size:
        raise UsageError("--prefix-size would force the references' first tokens into the teacher's outputs")
    require_int("--workers", args.workers, 1, error=UsageError)
    require_int("--num-shards", args.num_shards, 0, error=UsageError)  # 0: one per SENTENCES_PER_SHARD
    check_generation_options(parse_options(args), error=UsageError)
    for checkpoint in utils.split_paths(args.path):
        checkpoint_safety.check_readable(checkpoint)
    if args.max_tokens is None and args.batch_size is None:
        args.max_tokens = DEFAULT_MAX_TOKENS
    return args, convert_namespace_to_omegaconf(args)


# ---- the job: the split and its shards ----------------------------------------------------------
@dataclass
class Shard:
    index: int
    start: int  # first sentence id
    stop: int  # one past the last sentence id

    @property
    def size(self):
        return self.stop - self.start


@dataclass
class DistillJob:
    """What every process of a run knows: options, the split and its shards."""

    args: object  # argparse.Namespace, for the fastgen-distill options
    cfg: object  # fairseq config (omegaconf)
    task: object
    dataset: object  # the split, a LanguagePairDataset
    shards: List[Shard]
    output_dir: Path

    @property
    def split(self) -> str:
        return self.cfg.dataset.gen_subset

    @property
    def data_dir(self) -> Path:
        return Path(utils.split_paths(self.cfg.task.data)[0])

    @property
    def languages(self):
        return self.task.cfg.source_lang, self.task.cfg.target_lang

    @property
    def shard_dir(self) -> Path:
        return self.output_dir / SHARDS_DIR / self.split

    def shard_path(self, shard: Shard) -> Path:
        return self.shard_dir / f"shard-{shard.index:05d}-of-{len(self.shards):05d}.npz"

    def claim_path(self, shard: Shard) -> Path:
        return self.shard_path(shard).with_suffix(".claim")

    def shards_done(self) -> int:
        return sum(self.shard_path(s).exists() for s in self.shards)


def open_job(argv) -> DistillJob:
    args, cfg = parse(argv)
    task = tasks.setup_task(cfg.task)
    split = cfg.dataset.gen_subset
    data_dir = Path(utils.split_paths(cfg.task.data)[0])
    output_dir = Path(args.output_dir)
    if output_dir.resolve() == data_dir.resolve():
        raise UsageError("--output-dir must differ from DATA")
    prefix = split_prefix(data_dir, split, task.cfg.source_lang, task.cfg.target_lang)
    source_data = indexed_dataset.data_file_path(str(data_dir / (prefix + task.cfg.source_lang)))
    if os.path.getsize(source_data) == 0:  # fairseq cannot even open an empty split
        raise DistillError(f"split {split!r} of {data_dir} is empty: nothing to distill")
    task.load_dataset(split)
    dataset = task.dataset(split)
    sentences = len(dataset)
    count = min(cfg.dataset.num_shards or math.ceil(sentences / SENTENCES_PER_SHARD), sentences)
    shards = [Shard(i, i * sentences // count, (i + 1) * sentences // count) for i in range(count)]
    return DistillJob(args, cfg, task, dataset, shards, output_dir)


def run_settings(job: DistillJob) -> dict:
    """Everything the shards' content depends on, flat, as JSON values."""
    cfg = job.cfg
    teachers = [os.path.abspath(p) for p in utils.split_paths(cfg.common_eval.path)]
    settings = {
        "data": os.path.abspath(job.data_dir),
        "split": job.split,
        "sentences": len(job.dataset),
        "shards": len(job.shards),
        "teacher": [{"path": p, "bytes": os.path.getsize(p), "modified_ns": os.stat(p).st_mtime_ns} for p in teachers],
        "model_overrides": cfg.common_eval.model_overrides,
        "max_tokens": cfg.dataset.max_tokens,
        "batch_size": cfg.dataset.batch_size,
        "required_batch_size_multiple": cfg.dataset.required_batch_size_multiple,
        "seed": cfg.common.seed,
        "fp16": cfg.common.fp16,
    }
    generation = OmegaConf.to_container(cfg.generation, resolve=True)
    settings.update({f"generation.{name}": value for name, value in generation.items()})
    return json.loads(json.dumps(settings, default=str))


def claim_shard_dir(job: DistillJob):
    """Record the run's settings beside the shards, or check them against a previous run's."""
    settings = run_settings(job)
    path = job.shard_dir / "run.json"
    if path.exists():
        recorded = json.loads(path.read_text())
        changed = sorted(k for k in settings.keys() | recorded.keys() if settings.get(k) != recorded.get(k))
        if changed:
            raise DistillError(
                f"{job.shard_dir} holds shards made with other settings (changed: {', '.join(changed)}); "
                "use another --output-dir or delete that directory"
            )
        return
    job.shard_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: f.write(json.dumps(settings, indent=2, sort_keys=True).encode()))


def prepare(job: DistillJob):
    """Before any worker starts (one process per run): claim the shard directory,
    drop the claims an interrupted run left, and say what is left to do."""
    claim_shard_dir(job)
    for stale in job.shard_dir.glob("*.claim"):
        stale.unlink()
    remove_stale_temporaries(job.shard_dir)
    remove_stale_temporaries(job.output_dir)
    for shard in job.shards:  # what a resumed run keeps, checked before it is trusted
        if job.shard_path(shard).exists():
            load_shard(job, shard)
    done = job.shards_done()
    if done:
        logger.info("resuming: %d of %d shards of %r already done, %d to distill (%s)",
                    done, len(job.shards), job.split, len(job.shards) - done, job.shard_dir)
    else:
        logger.info("%d sentences of %r in %d shards", len(job.dataset), job.split, len(job.shards))


def take(job: DistillJob, shard: Shard) -> bool:
    """Claim ``shard`` for this worker; False when it is done or another worker holds it."""
    if job.shard_path(shard).exists():
        return False
    try:
        os.close(os.open(job.claim_path(shard), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    if job.shard_path(shard).exists():  # finished and released between the two checks
        job.claim_path(shard).unlink()
        return False
    return True


# ---- the teacher ----------------------------------------------------------------------------------
def saved_config(state):
    if state.get("cfg") is not None:
        return state["cfg"]
    return convert_namespace_to_omegaconf(state["args"])


def check_teacher_dictionaries(job: DistillJob, checkpoint: str, saved_cfg):
    recorded = getattr(saved_cfg.task, "data", None)
    teacher_data = job.args.teacher_data or (utils.split_paths(recorded)[0] if recorded else None)
    names = [f"dict.{lang}.txt" for lang in job.languages]
    if teacher_data is None or not all((Path(teacher_data) / name).exists() for name in names):
        if job.args.teacher_data:
            raise DistillError(f"--teacher-data {job.args.teacher_data} lacks {' or '.join(names)}")
        logger.warning("cannot check the dictionaries of the teacher %s: the data directory its checkpoint records "
                       "(%s) lacks them; give the teacher's data-bin with --teacher-data", checkpoint, recorded)
        return
    try:
        check_same_dictionaries(teacher_data, job.data_dir, job.languages,
                                f"the teacher {checkpoint} was trained with other dictionaries than DATA")
    except ValueError as error:
        raise DistillError(str(error)) from error


def load_teacher(job: DistillJob, device):
    cfg = job.cfg
    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    models = []
    for checkpoint in utils.split_paths(cfg.common_eval.path):
        state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint, overrides)
        check_teacher_dictionaries(job, checkpoint, saved_config(state))
        try:
            ensemble, _, _ = checkpoint_utils.load_model_ensemble_and_task(
                [checkpoint], arg_overrides=overrides, task=job.task, state=state
            )
        except RuntimeError as error:
            if "size mismatch" not in str(error):
                raise
            sizes = " / ".join(str(len(d)) for d in (job.task.source_dictionary, job.task.target_dictionary))
            raise DistillError(f"the teacher {checkpoint} does not fit DATA's dictionaries ({sizes} symbols): "
                               f"{error}") from error
        models.extend(ensemble)
    for model in models:
        if cfg.common.fp16:
            model.half()
        model.to(device)
        model.prepare_for_inference_(cfg)
    return models


def worker_device(job: DistillJob, rank: int):
    if job.cfg.common.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# ---- a worker ------------------------------------------------------------------------------------------
def distill_shards(job: DistillJob, rank: int, workers: int, decoder: Optional["ShardDecoder"] = None):
    """Take shards no other worker holds until none is left, writing one shard file each.

    Worker ``rank`` starts its search at shard rank * shards / workers, so that
    workers begin in different places and a fast one goes on with the rest.
    ``decoder``: the worker's teacher, when the caller built it already.
    """
    if job.shards_done() == len(job.shards):
        logger.info("worker %d: no shard left to distill", rank)
        if decoder is not None:
            decoder.close()
        return
    decoder = decoder or ShardDecoder(job, rank)
    first = rank * len(job.shards) // workers
    stop_after = int(os.environ.get(STOP_AFTER_SHARDS_ENV, 0))
    decoded = 0
    for shard in job.shards[first:] + job.shards[:first]:
        if not take(job, shard):
            continue
        started, cpu_started = time.time(), time.process_time()
        targets, truncated = decoder.decode(shard)
        content = ShardContent(np.arange(shard.start, shard.stop), targets, truncated,
                               started, time.time() - started, time.process_time() - cpu_started)
        write_shard_file(job.shard_path(shard), content)
        job.claim_path(shard).unlink()
        decoded += 1
        if truncated:
            logger.warning("worker %d: shard %d: %d sources longer than the teacher's %d positions were truncated "
                           "(sentence ids %s)", rank, shard.index, len(truncated), decoder.max_source, truncated[:10])
        logger.info("worker %d: shard %d/%d done: %d sentences in %.1fs (%.1f sentences/s); %d of %d shards done",
                    rank, shard.index + 1, len(job.shards), shard.size, content.seconds,
                    shard.size / content.seconds, job.shards_done(), len(job.shards))
        if decoded == stop_after:
            logger.warning("worker %d: stopping after %d shards as %s asks", rank, decoded, STOP_AFTER_SHARDS_ENV)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INTERRUPTED_EXIT_CODE)
    decoder.close()
    logger.info("worker %d: decoded %d shards", rank, decoded)


class ShardDecoder:
    """One worker's teacher, decoding a shard in fairseq-generate's batches."""

    def __init__(self, job: DistillJob, rank: int):
        self.job = job
        self.device = worker_device(job, rank)
        self.models = load_teacher(job, self.device)
        self.generator = job.task.build_generator(self.models, job.cfg.generation)
        positions = utils.resolve_max_positions(job.task.max_positions(), *[m.max_positions() for m in self.models])
        self.max_source = positions[0]
        with data_utils.numpy_seed(job.cfg.common.seed):
            self.length_order = job.dataset.ordered_indices()  # (sentences,) fairseq-generate's batching order
        self.progress = tqdm(unit="sent", desc=f"worker {rank}", position=rank, dynamic_ncols=True,
                             disable=job.cfg.common.no_progress_bar)
        self.rank = rank

    def decode(self, shard: Shard):
        """The teacher's best hypothesis for every sentence of ``shard``, in sentence order,
        and the ids of the sentences whose source was truncated."""
        job = self.job
        utils.set_torch_seed(job.cfg.common.seed + shard.index)  # sampling decoders: independent of the worker
        in_shard = (self.length_order >= shard.start) & (self.length_order < shard.stop)
        batches = job.dataset.batch_by_size(
            self.length_order[in_shard],
            max_tokens=job.cfg.dataset.max_tokens,
            max_sentences=job.cfg.dataset.batch_size,
            required_batch_size_multiple=job.cfg.dataset.required_batch_size_multiple,
        )
        best = {}
        truncated = []
        for batch in batches:
            items = [job.dataset[i] for i in batch]
            for item in items:
                if len(item["source"]) > self.max_source:  # keep the first max_source - 1 tokens and the final eos
                    item["source"] = torch.cat([item["source"][: self.max_source - 1], item["source"][-1:]])
                    truncated.append(int(item["id"]))
            sample = job.dataset.collater(items)
            if self.device.type == "cuda":
                sample = utils.move_to_cuda(sample, device=self.device)
            hypotheses = job.task.inference_step(self.generator, self.models, sample)
            for row, sentence in enumerate(sample["id"].tolist()):
                best[sentence] = hypotheses[row][0]["tokens"].int().cpu().numpy()
            self.progress.update(len(batch))
        if sorted(best) != list(range(shard.start, shard.stop)):
            raise DistillError(f"shard {shard.index}: decoded {len(best)} of its {shard.size} sentences")
        return [best[i] for i in range(shard.start, shard.stop)], sorted(truncated)

    def close(self):
        self.progress.close()
        if hasattr(self.generator, "counters"):
            logger.info("worker %d: %s", self.rank, self.generator.counters.summary())


# ---- shard files -------------------------------------------------------------------------------------
@dataclass
class ShardContent:
    ids: np.ndarray  # (sentences,) the shard's sentence ids, in order
    targets: List[np.ndarray]  # one (length,) int32 array per sentence, ending in eos
    truncated: List[int]  # ids of the sentences whose source was truncated
    started: float  # time.time() when decoding began
    seconds: float  # wall-clock decoding time
    cpu_seconds: float  # CPU time of the worker process while decoding


def write_shard_file(path, content: ShardContent):
    lengths = np.array([len(t) for t in content.targets], dtype=np.int64)  # (sentences,)
    tokens = np.concatenate(content.targets).astype(np.int32)  # (sum of lengths,)
    write_atomically(path, lambda f: np.savez(
        f, ids=content.ids, lengths=lengths, tokens=tokens, truncated=np.array(content.truncated, dtype=np.int64),
        started=content.started, seconds=content.seconds, cpu_seconds=content.cpu_seconds,
    ))


def read_shard_file(path) -> ShardContent:
    try:
        with np.load(path) as stored:
            targets = np.split(stored["tokens"], np.cumsum(stored["lengths"])[:-1])
            return ShardContent(stored["ids"], targets, stored["truncated"].tolist(), float(stored["started"]),
                                float(stored["seconds"]), float(stored["cpu_seconds"]))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:  # cut short, damaged, foreign
        raise DistillError(f"shard file {path} is damaged ({type(error).__name__}: {error}); delete it and run "
                           "the same command again to decode that shard again") from error


def load_shard(job: DistillJob, shard: Shard) -> ShardContent:
    """A finished shard's content, checked: it holds its sentences, each exactly once."""
    path = job.shard_path(shard)
    content = read_shard_file(path)
    if not np.array_equal(content.ids, np.arange(shard.start, shard.stop)) or len(content.targets) != shard.size:
        raise DistillError(f"{path} does not hold sentences {shard.start}..{shard.stop - 1} exactly once; "
                           "delete it and run again")
    return content


# ---- merging ------------------------------------------------------------------------------------------
def merge_shards(job: DistillJob, run_started: float, workers: int) -> dict:
    """Check that every sentence has exactly one target, then write the data-bin and the summary."""
    missing = [s.index for s in job.shards if not job.shard_path(s).exists()]
    if missing:
        raise DistillError(f"refusing to write an incomplete data-bin: shards {missing} of {len(job.shards)} are "
                           "missing; run the same command again to distill them")
    targets, truncated, this_run = [], [], []
    for shard in job.shards:
        content = load_shard(job, shard)
        targets.extend(content.targets)
        truncated.extend(content.truncated)
        if content.started >= run_started:
            this_run.append(content)
    if len(targets) != len(job.dataset):
        raise DistillError(f"refusing to write an incomplete data-bin: {len(targets)} targets for "
                           f"{len(job.dataset)} sentences")
    write_data_bin(job, targets)
    summary = run_summary(job, targets, truncated, this_run, run_started, workers)
    summary_text = json.dumps(summary, indent=2).encode()
    write_atomically(job.output_dir / f"distill.{job.split}.json", lambda f: f.write(summary_text))
    return summary


def split_prefix(data_dir: Path, split, src, tgt) -> str:
    """``SPLIT.SRC-TGT.`` or ``SPLIT.TGT-SRC.``, whichever DATA uses (as fairseq's translation task)."""
    for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
        if (data_dir / f"{split}.{pair}.{src}.idx").exists():
            return f"{split}.{pair}."
    raise DistillError(f"{data_dir} has no binarized split {split!r} for {src}-{tgt}")


def copy_recorded(source: Path, destination: Path, manifest: FileManifest):
    copy_atomically(source, destination)
    manifest.record(destination, "copy")


def indexed_files(prefix) -> List[Path]:
    """The data and index files of an indexed dataset."""
    return [Path(path_of(str(prefix))) for path_of in (indexed_dataset.data_file_path, indexed_dataset.index_file_path)]


def write_data_bin(job: DistillJob, targets: List[np.ndarray]):
    data_dir, out = job.data_dir, job.output_dir
    src, tgt = job.languages
    prefix = split_prefix(data_dir, job.split, src, tgt)
    source = data_dir / (prefix + src)
    dataset_impl = indexed_dataset.infer_dataset_impl(str(source))
    if dataset_impl not in ("mmap", "cached"):
        raise DistillError(f"{source}: dataset format {dataset_impl!r} is not supported; "
                           "binarize with fairseq-preprocess")
    manifest = open_manifest(job)
    for lang in (src, tgt):
        copy_recorded(data_dir / f"dict.{lang}.txt", out / f"dict.{lang}.txt", manifest)
    for original, copy in zip(indexed_files(source), indexed_files(out / (prefix + src))):
        copy_recorded(original, copy, manifest)
    tmp = str(out / f".{prefix}{tgt}.{os.getpid()}.tmp")
    builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(tmp), dataset_impl,
                                           vocab_size=len(job.task.target_dictionary))
    for tokens in targets:
        builder.add_item(torch.from_numpy(tokens))
    builder.finalize(indexed_dataset.index_file_path(tmp))
    write_step(f"{prefix}{tgt} targets written to their temporary files")
    for written, final in zip(indexed_files(tmp), indexed_files(out / (prefix + tgt))):
        os.replace(written, final)
        write_step(f"{final.name} renamed")
        manifest.record(final, "distilled")
    copy_other_splits(job, prefix, manifest)


def open_manifest(job: DistillJob) -> FileManifest:
    try:
        return FileManifest(job.output_dir, MANIFEST)
    except ValueError as error:
        raise DistillError(str(error)) from error


def copy_other_splits(job: DistillJob, prefix: str, manifest: FileManifest):
    """Copy DATA's other splits (valid, test) so that OUT alone is a complete data-bin;
    files OUT already holds (copied, or distilled by an earlier run) are kept once checked."""
    src, tgt = job.languages
    pairs = "|".join(re.escape(p) for p in (f"{src}-{tgt}", f"{tgt}-{src}"))
    langs = "|".join(re.escape(lang) for lang in (src, tgt))
    pattern = re.compile(rf"(?P<split>[^.]+)\.(?:{pairs})\.(?:{langs})\.(?:bin|idx)")
    for path in job.data_dir.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None or re.fullmatch(rf"{re.escape(job.split)}\d*", match["split"]):
            continue  # not a split file, or this split (and its fairseq continuation files SPLIT1, ...)
        kept = job.output_dir / path.name
        if not kept.exists() or not keep_checked(kept, path, manifest):
            copy_recorded(path, kept, manifest)


def keep_checked(kept: Path, original: Path, manifest: FileManifest) -> bool:
    """Whether OUT's file ``kept`` (for DATA's ``original``) is whole: what this tool recorded writing, or DATA's
    file byte for byte.  False for a damaged copy (copied again); a damaged distilled file is refused."""
    problem = manifest.problem(kept)
    if problem is None:
        return True
    origin = manifest.origin(kept)
    if origin == "distilled":
        raise DistillError(f"{kept} (distilled by an earlier run) is damaged: {problem}; delete it and distill "
                           "that split again")
    if origin is None:
        if not filecmp.cmp(kept, original, shallow=False):
            raise DistillError(f"{kept} is neither DATA's {original} nor a file this tool recorded writing; "
                               "delete it to copy DATA's")
        manifest.record(kept, "copy")
        return True
    logger.warning("%s is damaged (%s); copying %s again", kept, problem, original)
    return False


def teacher_bleu(job: DistillJob, targets: List[np.ndarray]):
    """sacreBLEU of the teacher's outputs against the split's original targets (None without targets)."""
    references = job.dataset.tgt
    if references is None:
        return None
    tgt_dict = job.task.target_dictionary
    tokenizer = job.task.build_tokenizer(job.cfg.tokenizer)
    bpe = job.task.build_bpe(job.cfg.bpe)

    def text(tokens, escape_unk=False):
        line = tgt_dict.string(tokens, job.cfg.common_eval.post_process, escape_unk=escape_unk)
        if bpe is not None:
            line = bpe.decode(line)
        return tokenizer.decode(line) if tokenizer is not None else line

    hypotheses = [text(torch.from_numpy(t)) for t in targets]
    originals = [text(references[i], escape_unk=True) for i in range(len(references))]
    return sacrebleu.corpus_bleu(hypotheses, [originals])


def run_summary(job, targets, truncated, this_run, run_started, workers) -> dict:
    decoded = sum(len(c.targets) for c in this_run)
    cpu_seconds = sum(c.cpu_seconds for c in this_run)
    decoding_seconds = (max(c.started + c.seconds for c in this_run) - min(c.started for c in this_run)
                        if this_run else 0.0)
    bleu = teacher_bleu(job, targets)
    summary = {
        "split": job.split,
        "sentences": len(targets),
        "shards": len(job.shards),
        "truncated_sources": len(truncated),
        "truncated_sentence_ids": truncated,
        "teacher_bleu": None if bleu is None else bleu.score,
        "teacher_bleu_details": None if bleu is None else str(bleu),
        "workers": workers,
        "sentences_this_run": decoded,
        "decoding_seconds": decoding_seconds,
        "sentences_per_second": decoded / decoding_seconds if decoding_seconds else None,
        "decoding_cpu_seconds": cpu_seconds,
        "sentences_per_cpu_second": decoded / cpu_seconds if cpu_seconds else None,
        "wall_seconds": time.time() - run_started,
        "settings": run_settings(job),
    }
    rate = f"{decoded / decoding_seconds:.1f}" if decoding_seconds else "-"
    logger.info("distilled %r: %d sentences into %s; this run decoded %d sentences in %.1fs (%s sentences/s with "
                "%d worker processes, %.1f CPU seconds), %.1fs in all", job.split, len(targets), job.output_dir,
                decoded, decoding_seconds, rate, workers, cpu_seconds, summary["wall_seconds"])
    if truncated:
        logger.warning("%d sources were longer than the teacher's maximum positions and were truncated before "
                       "decoding (sentence ids in %s)", len(truncated), job.output_dir / f"distill.{job.split}.json")
    if bleu is not None:
        logger.info("teacher against the original targets of %r: %s", job.split, bleu)
    return summary


# ---- running: one process, --workers N, or torchrun ---------------------------------------------------------
def main(argv=None) -> Optional[dict]:
    """Run fastgen-distill; return the summary in the process that merged (None in the others)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run_started = time.time()
    job = open_job(argv)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return run_torchrun_rank(job, run_started)
    if job.args.workers > 1:
        return run_spawned_workers(job, argv, run_started)
    decoder = ShardDecoder(job, rank=0)  # first: a teacher or decoder that does not fit is refused before any file
    prepare(job)
    distill_shards(job, rank=0, workers=1, decoder=decoder)
    return merge_shards(job, run_started, workers=1)


def run_torchrun_rank(job: DistillJob, run_started: float):
    import torch.distributed as dist

    if job.args.workers != 1:
        raise DistillError("under torchrun every rank is one worker: leave --workers at 1")
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            prepare(job)
        dist.barrier()
        distill_shards(job, rank, world)
        dist.barrier()
        return merge_shards(job, run_started, workers=world) if rank == 0 else None
    finally:
        dist.destroy_process_group()


def run_spawned_workers(job: DistillJob, argv, run_started: float):
    from torch.multiprocessing.spawn import ProcessException

    workers = job.args.workers
    check_teacher_takes_the_decoder(job)
    prepare(job)
    context = torch.multiprocessing.start_processes(spawned_worker, args=(argv, workers), nprocs=workers,
                                                    join=False)
    try:
        while not context.join():  # on a worker's failure, join ends the others and raises
            pass
    except ProcessException as error:
        message = f"a worker failed; its finished shards are kept and the same command resumes:\n{error}"
        raise DistillError(message) from error
    except BaseException:  # a signal (Stopped) or anything else here: no worker may outlive this process
        end_workers(context.processes)
        raise
    return merge_shards(job, run_started, workers)


def check_teacher_takes_the_decoder(job: DistillJob):
    """Load the teacher and build its decoder once here, before any worker starts: a teacher or a decoder that
    does not fit (another dictionary, --decoder blockwise for a stock model, ...) is refused in one line,
    not once per worker after each has loaded it."""
    models = load_teacher(job, torch.device("cpu"))
    job.task.build_generator(models, job.cfg.generation)
    del models
    gc.collect()


def end_workers(processes):
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join()


def spawned_worker(rank, argv, workers):
    # torch asks for SIGINT when this worker's parent dies (prctl); a worker started with SIGINT ignored
    # (from a shell's background job) would miss it and go on decoding as an orphan
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a spawned process inherits the spawn start method, and fairseq's data loader (its worker, its queues) would
    # then register its semaphores with the parent's resource tracker: a worker ended by SIGTERM never unregisters
    # them, and the tracker prints "leaked semaphore objects" after the parent's report. Forked, as in any process
    # started on its own, they are unlinked as soon as they are made
    multiprocessing.set_start_method("fork", force=True)
    configure_logging()
    if "OMP_NUM_THREADS" not in os.environ:  # share this machine's cores between the workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // workers))
    distill_shards(open_job(argv), rank, workers)


def configure_logging():
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stdout,
        force=True,  # importing fairseq already installed a DEBUG handler on stderr
    )


def cli_main(argv=None):
    configure_logging()
    try:
        with StopSignals():
            exit_on_usage_error("fastgen-distill")(main)(argv)  # a misuse: one error line, exit status 2
    except DistillError as error:
        logger.error("%s", error)
        sys.exit(1)
    except Stopped as stop:
        logger.error("fastgen-distill: %s; %s", stop, shards_left_report(argv))
        sys.exit(stop.exit_status)


def shards_left_report(argv) -> str:
    """What a stopped run finished: the shards on disk (the same command resumes from them)."""
    try:
        job = open_job(list(sys.argv[1:] if argv is None else argv))
    except Exception:  # noqa: BLE001  (the report must not fail where the run did not get this far)
        return "its workers were stopped"
    return (f"{job.shards_done()} of {len(job.shards)} shards of {job.split!r} are done and kept in {job.shard_dir}, "
            "the others are not; the same command resumes from them (OUT is a complete data-bin only after a run "
            "that ends with status 0); its workers were stopped")


if __name__ == "__main__":
    # call the importable module's cli_main, so that spawned workers find their function by name
    from fairseq_fastgen.distill import cli_main as importable_cli_main

    importable_cli_main()
