"""``fastgen-train-clusters``: build the cluster file of ``--cluster-projection``.

    fastgen-train-clusters DATA --path CKPT --split train --num-clusters 1000 \\
        --top-k 1 --max-states 500000 --output clusters.pt [--source-only]

On a multilingual model (``--task translation_multi_simple_epoch``, one shared
transformer over ``--lang-pairs``) ``--output`` is a directory: the states are
recorded per direction and written as one file per direction
(``--cluster-scope direction``, the default) or per target language
(``--cluster-scope target``: the states of every direction into it pooled),
with an index (:mod:`fairseq_fastgen.cluster.directory`). A bilingual model
writes a directory too when ``--output`` is an existing directory.

1. Runs the model over a split of the data-bin and records the decoder's final
   hidden states (the input of the vocabulary projection) and, per state, the
   model's top-K tokens. By default the decoder is teacher-forced on the target
   text; with ``--source-only`` it decodes the source greedily and the states of
   that free-running decoding are recorded (for unlabelled data).
2. Clusters the states with faiss k-means (on GPU when faiss has one).
3. Gives each cluster the union of its members' top-K tokens plus the
   dictionary's special symbols except pad (which fairseq bans anyway).
   A multilingual model's clusters also keep the target language token the
   decoder is forced to start with.
4. Fits each cluster's estimate of the softmax mass outside its active tokens
   (:mod:`fairseq_fastgen.cluster.outside_mass`), the default normaliser of
   decoding with the file.
5. Writes the file (format: :mod:`fairseq_fastgen.cluster.clusterfile`),
   to a temporary name renamed into place; a directory's index last.
"""

import argparse
import logging
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from fairseq import checkpoint_utils, utils
from fairseq.data import data_utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, ModelFingerprint, output_projection_of
from fairseq_fastgen.cluster.directory import write_directory
from fairseq_fastgen.cluster.multilingual import (
    direction_task, is_multilingual, model_directions, target_language_tokens,
)
from fairseq_fastgen.cluster.outside_mass import fit_outside_mass
from fairseq_fastgen.cluster.projection import nearest_clusters
from fairseq_fastgen.option_checks import exit_on_usage_error
from fairseq_fastgen.ops.cluster_union import ClusterActiveSets
from fairseq_fastgen.option_checks import require_int

logger = logging.getLogger("fastgen-train-clusters")

ASSIGNMENT_CHUNK = 65536  # states per nearest-centroid matmul when assigning members
MAX_SEED = 2**31 - 1  # numpy takes 0 .. 2**32 - 1 (fairseq adds the epoch), faiss a C int
SCOPE_CHOICES = ChoiceEnum(["direction", "target"])


@dataclass
class ClusterTrainingConfig(FairseqDataclass):
    # data is positional on the command line; path and output are checked by cli_main
    data: str = field(default="", metadata={"help": "fairseq data-bin directory (the model's dictionaries)"})
    path: str = field(default="", metadata={"help": "model checkpoint (required)"})
    output: str = field(default="", metadata={
        "help": "cluster file to write (required); for a multilingual model (task translation_multi_simple_epoch) "
                "a directory, created when absent, that receives one file per direction or target language "
                "and index.json (an existing directory is also written so for a bilingual model)"})
    cluster_scope: SCOPE_CHOICES = field(
        default="direction",
        metadata={"help": "one cluster file per language direction ('direction'), or per target language with "
                          "the states of every direction into it pooled ('target')"},
    )
    split: str = field(default="train", metadata={"help": "data-bin split whose sentences are run"})
    source_only: bool = field(
        default=False,
        metadata={"help": "decode the source text greedily and record those states (no target text needed) "
                          "instead of teacher-forcing the target text"},
    )
    num_clusters: int = field(default=1000, metadata={"help": "number of k-means clusters"})
    top_k: int = field(default=1, metadata={"help": "tokens added to a cluster's active set per member state"})
    max_states: int = field(default=500000, metadata={
        "help": "record at most this many decoder states (per direction of a multilingual model)"})
    iterations: int = field(default=20, metadata={"help": "k-means iterations"})
    max_tokens: Optional[int] = field(default=4000, metadata={"help": "tokens per batch"})
    batch_size: Optional[int] = field(default=None, metadata={"help": "sentences per batch"})
    seed: int = field(default=1, metadata={"help": "seed of the sentence order and of k-means"})
    cpu: bool = field(default=False, metadata={"help": "run the model and k-means on the CPU"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastgen-train-clusters",
        description="Cluster a model's decoder states for --cluster-projection.",
    )
    gen_parser_from_dataclass(parser, ClusterTrainingConfig())
    return parser


def cli_main(argv=None):
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs every instruction set it tries
    parser = build_parser()
    args = parser.parse_args(argv)
    for required in ("path", "output"):
        if not getattr(args, required):
            parser.error(f"--{required} is required")
    cfg = ClusterTrainingConfig(**{f.name: getattr(args, f.name) for f in fields(ClusterTrainingConfig)
                                   if not f.name.startswith("_")})
    # a setting that makes no sense, a checkpoint that is not loaded: one error line, exit status 2, as every tool
    exit_on_usage_error("fastgen-train-clusters")(train_clusters)(cfg)


def check_counts(cfg: ClusterTrainingConfig, vocab_size: Optional[int] = None):
    """Refuse cluster and K settings that make no sense, before any work is done."""
    if cfg.num_clusters < 1:
        raise ClusterFileError(f"--num-clusters must be at least 1, got {cfg.num_clusters}")
    if cfg.iterations < 1:
        raise ClusterFileError(f"--iterations must be at least 1, got {cfg.iterations}")
    if cfg.max_states < cfg.num_clusters:
        raise ClusterFileError(f"--max-states {cfg.max_states} is below --num-clusters {cfg.num_clusters}: "
                               f"k-means needs at least one state per cluster")
    if cfg.top_k < 1 or (vocab_size is not None and cfg.top_k > vocab_size):
        bound = f"the vocabulary size {vocab_size}" if vocab_size is not None else "the vocabulary size"
        raise ClusterFileError(f"--top-k must be between 1 and {bound}, got {cfg.top_k}")
    for option, value in (("--max-tokens", cfg.max_tokens), ("--batch-size", cfg.batch_size)):
        if value is not None:
            require_int(option, value, 1, error=ClusterFileError)
    require_int("--seed", cfg.seed, 0, MAX_SEED, error=ClusterFileError)


class Recording(NamedTuple):
    """The decoder states of one direction and their top-K tokens."""

    source_lang: Optional[str]
    target_lang: Optional[str]
    states: np.ndarray  # (states, hidden) float32
    top_tokens: np.ndarray  # (states, K) int64


def train_clusters(cfg: ClusterTrainingConfig) -> List[ClusterFile]:
    """Record, cluster and write; returns the files written (one for a bilingual model's file)."""
    check_counts(cfg)
    output = Path(cfg.output)
    if not output.resolve().parent.is_dir():
        raise ClusterFileError(f"--output {cfg.output}: its folder does not exist")
    model, task = load_model(cfg, load_split=False)
    fingerprint = ModelFingerprint.of_decoder(model.decoder)
    check_counts(cfg, fingerprint.vocab_size)
    multilingual = is_multilingual(task)
    as_directory = multilingual or output.is_dir()
    if multilingual and output.exists() and not output.is_dir():
        raise ClusterFileError(f"--output {cfg.output} is a file; a multilingual model's clusters go into a directory")
    with torch.no_grad():
        recordings = record_directions(model, task, cfg) if multilingual else [record_model_direction(model, task, cfg)]
    groups = group_by_scope(recordings, cfg.cluster_scope)
    for (source_lang, target_lang), members in groups.items():
        check_enough_states(cfg, members, f" ({cfg.cluster_scope} {source_lang or '*'}-{target_lang})"
                            if as_directory else "")
    specials = special_tokens(task.target_dictionary)
    projection = output_projection_of(model.decoder)
    cluster_files = []
    for (source_lang, target_lang), members in groups.items():
        extra = target_language_tokens(task, target_lang) if multilingual else []
        cluster_files.append(cluster_file_of(cfg, members, fingerprint, specials + extra, source_lang, target_lang,
                                             projection))
    if as_directory:
        paths = write_directory(output, cluster_files)
    else:
        cluster_files[0].save(output)
        paths = [output]
    for cluster_file, path in zip(cluster_files, paths):
        sizes = cluster_file.offsets.diff().float()
        logger.info("wrote %s (%s): %d clusters from %d states, active set size mean %.1f max %d of %d tokens",
                    path, cluster_file.serves(), cluster_file.num_clusters, cluster_file.states, sizes.mean(),
                    sizes.max(), fingerprint.vocab_size)
    return cluster_files


def record_model_direction(model, task, cfg: ClusterTrainingConfig) -> Recording:
    """A bilingual model's states (its task's direction)."""
    task.load_dataset(cfg.split)
    return Recording(task.cfg.source_lang, task.cfg.target_lang, *record_states(model, task, cfg))


def record_directions(model, task, cfg: ClusterTrainingConfig) -> List[Recording]:
    """A multilingual model's states, up to ``--max-states`` per direction of its ``--lang-pairs``."""
    recordings = []
    for source_lang, target_lang in model_directions(task):
        logger.info("direction %s-%s", source_lang, target_lang)
        one_direction = direction_task(task, source_lang, target_lang)
        one_direction.load_dataset(cfg.split)
        recordings.append(Recording(source_lang, target_lang, *record_states(model, one_direction, cfg)))
    return recordings


def group_by_scope(recordings: List[Recording], scope: str) -> Dict[Tuple[Optional[str], str], List[Recording]]:
    """(source or None, target) of each file to write -> the recordings it clusters."""
    groups = {}
    for recording in recordings:
        key = (recording.source_lang, recording.target_lang) if scope == "direction" else (None, recording.target_lang)
        groups.setdefault(key, []).append(recording)
    return groups


def check_enough_states(cfg: ClusterTrainingConfig, recordings: List[Recording], what: str):
    states = sum(r.states.shape[0] for r in recordings)
    if cfg.num_clusters > states:
        raise ClusterFileError(f"--num-clusters {cfg.num_clusters} exceeds the {states} decoder states "
                               f"of split {cfg.split!r}{what}; use fewer clusters or more data")


def cluster_file_of(cfg: ClusterTrainingConfig, recordings: List[Recording], fingerprint: ModelFingerprint,
                    specials, source_lang: Optional[str], target_lang: Optional[str], projection) -> ClusterFile:
    """k-means over the recordings' states pooled, the clusters' active sets, and their estimates of the mass
    outside them (``projection``: the decoder's output projection)."""
    states = np.ascontiguousarray(np.concatenate([r.states for r in recordings]))  # (states, hidden)
    top_tokens = np.concatenate([r.top_tokens for r in recordings])  # (states, K)
    centroids = kmeans_centroids(states, cfg)
    assignment = assign_states(torch.from_numpy(states), centroids)  # (states,)
    active_sets = cluster_active_sets(states, top_tokens, centroids, specials, fingerprint.vocab_size, assignment)
    logger.info("estimating the mass outside each cluster's %d tokens on average",
                active_sets.tokens.numel() // centroids.size(0))
    intercepts, gradients = fit_outside_mass(torch.from_numpy(states), assignment, centroids, active_sets,
                                             projection.weight.detach().cpu(), None if projection.bias is None
                                             else projection.bias.detach().cpu())
    return ClusterFile.build(
        centroids, active_sets, fingerprint, top_k=cfg.top_k, states=int(states.shape[0]),
        source_lang=source_lang, target_lang=target_lang, scope=cfg.cluster_scope,
        training={"checkpoint": cfg.path, "split": cfg.split, "source_only": cfg.source_only,
                  "iterations": cfg.iterations, "seed": cfg.seed,
                  "directions": [f"{r.source_lang}-{r.target_lang}" for r in recordings]},
        outside_intercepts=intercepts, outside_gradients=gradients,
    )


def load_model(cfg: ClusterTrainingConfig, load_split=True):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([cfg.path], arg_overrides={"data": cfg.data})
    model = models[0].eval()
    if not cfg.cpu and torch.cuda.is_available():
        model = model.cuda()
    if load_split:
        task.load_dataset(cfg.split)
    return model, task


# ---- 1. decoder states ------------------------------------------------------------------------
def record_states(model, task, cfg: ClusterTrainingConfig) -> Tuple[np.ndarray, np.ndarray]:
    """Up to ``max_states`` final decoder states (states, hidden) float32 and their
    top-K tokens (states, K) int64, from sentences in a seeded random order."""
    dataset = task.dataset(cfg.split)
    batches = task.get_batch_iterator(
        dataset=dataset, max_tokens=cfg.max_tokens, max_sentences=cfg.batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=cfg.seed,
    ).next_epoch_itr(shuffle=True)
    generator = greedy_generator(model, task) if cfg.source_only else None
    device = next(model.parameters()).device
    state_parts, token_parts, recorded = [], [], 0
    with tqdm(total=cfg.max_states, unit="states", desc="decoder states", file=sys.stderr) as progress:
        for sample in batches:
            sample = utils.move_to_cuda(sample, device) if device.type == "cuda" else sample
            if generator is not None:
                prev_output_tokens, targets = greedy_targets(generator, model, task, sample)
            else:
                prev_output_tokens, targets = sample["net_input"]["prev_output_tokens"], sample["target"]
            states, tokens = states_and_top_tokens(model, sample, prev_output_tokens, targets, cfg.top_k,
                                                   task.target_dictionary.pad())
            states, tokens = states[: cfg.max_states - recorded], tokens[: cfg.max_states - recorded]
            state_parts.append(states.float().cpu().numpy())
            token_parts.append(tokens.cpu().numpy())
            recorded += states.size(0)
            progress.update(states.size(0))
            if recorded >= cfg.max_states:
                break
    if recorded == 0:
        raise ClusterFileError(f"split {cfg.split!r} gave no decoder states")
    return np.ascontiguousarray(np.concatenate(state_parts)), np.concatenate(token_parts)


def states_and_top_tokens(model, sample, prev_output_tokens, targets, top_k, pad):
    """Decoder features at every non-pad target position and their top-K tokens (pad excluded)."""
    net_input = sample["net_input"]
    features, _ = model(net_input["src_tokens"], net_input["src_lengths"], prev_output_tokens,
                        features_only=True)  # (sentences, tgt_len, hidden)
    states = features[targets.ne(pad)]  # (states, hidden)
    logits = model.decoder.output_layer(states)  # (states, vocab)
    logits[:, pad] = -math.inf
    return states, logits.topk(top_k, dim=-1).indices


def greedy_generator(model, task):
    from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class, bound at import

    return task.build_generator([model], OmegaConf.structured(GenerationConfig(beam=1, decoder="greedy")))


def greedy_targets(generator, model, task, sample):
    """The model's greedy translations of the batch, as teacher-forcing input and target."""
    hypotheses = task.inference_step(generator, [model], sample)
    outputs = [hyps[0]["tokens"] for hyps in hypotheses]  # each ends in eos
    pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
    targets = data_utils.collate_tokens(outputs, pad, eos, left_pad=False)  # (sentences, length)
    prev_output_tokens = data_utils.collate_tokens(outputs, pad, eos, left_pad=False, move_eos_to_beginning=True)
    return prev_output_tokens, targets


# ---- 2. k-means ----------------------------------------------------------------------------------
def kmeans_centroids(states: np.ndarray, cfg: ClusterTrainingConfig) -> torch.Tensor:
    import faiss

    use_gpu = not cfg.cpu and faiss.get_num_gpus() > 0
    logger.info("k-means: %d clusters of %d states (dim %d), %d iterations, on %s",
                cfg.num_clusters, states.shape[0], states.shape[1], cfg.iterations, "GPU" if use_gpu else "CPU")
    kmeans = faiss.Kmeans(states.shape[1], cfg.num_clusters, niter=cfg.iterations, seed=cfg.seed, gpu=use_gpu)
    kmeans.train(states)
    return torch.from_numpy(kmeans.centroids.copy())  # (clusters, hidden)


# ---- 3. active sets ----------------------------------------------------------------------------
def special_tokens(dictionary):
    """Symbols every cluster keeps: bos, eos, unk and any other special symbol, but not pad."""
    return [index for index in range(dictionary.nspecial) if index != dictionary.pad()]


def assign_states(states: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """(states,) each state's nearest cluster, by the rule decoding uses; states (states, hidden)."""
    sqnorms = centroids.pow(2).sum(dim=1)
    return torch.cat([nearest_clusters(states[i: i + ASSIGNMENT_CHUNK], centroids, sqnorms)
                      for i in range(0, states.size(0), ASSIGNMENT_CHUNK)])


def cluster_active_sets(states: np.ndarray, top_tokens: np.ndarray, centroids: torch.Tensor, specials,
                        vocab_size: int, assignment: Optional[torch.Tensor] = None) -> ClusterActiveSets:
    """Per cluster: the union of its members' top-K tokens and ``specials``.

    Members are assigned with the same nearest-centroid rule as decoding uses
    (``assignment``, where given). A cluster left without members takes the
    top-K tokens of its nearest state.
    """
    states_t = torch.from_numpy(states)
    if assignment is None:
        assignment = assign_states(states_t, centroids)
    assignment = assignment.numpy()  # (states,)
    clusters = centroids.size(0)
    top_tokens = top_tokens.copy()
    empty = np.flatnonzero(np.bincount(assignment, minlength=clusters) == 0)
    if empty.size:
        logger.warning("%d clusters have no member; each takes the tokens of its nearest state", empty.size)
        nearest_state = nearest_clusters(centroids[empty], states_t, states_t.pow(2).sum(dim=1)).numpy()
        assignment = np.concatenate([assignment, empty])
        top_tokens = np.concatenate([top_tokens, top_tokens[nearest_state]])
    pairs = assignment[:, None].astype(np.int64) * vocab_size + top_tokens  # (states, K) cluster*V + token
    special_pairs = np.arange(clusters, dtype=np.int64)[:, None] * vocab_size + np.asarray(specials, dtype=np.int64)
    pairs = np.union1d(pairs.ravel(), special_pairs.ravel())  # sorted by cluster, then token
    counts = np.bincount(pairs // vocab_size, minlength=clusters)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return ClusterActiveSets(torch.from_numpy(offsets).long(), torch.from_numpy(pairs % vocab_size).long())


if __name__ == "__main__":
    cli_main()
