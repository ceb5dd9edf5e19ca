"""Cluster-projected vocabulary at inference (``--cluster-projection FILE`` or ``DIR``).

``DIR`` is a multilingual model's directory of cluster files: the run's
``--source-lang``/``--target-lang`` pick the direction's file, else the target
language's (:mod:`fairseq_fastgen.cluster.directory`); a single file of another
direction or target language than the run's is refused.

At every decoder step each hidden state h picks its nearest centroid
(argmin over clusters of ||C||^2 - 2 h.C); the active sets of the picked
clusters, united over the whole batch, give the vocabulary columns that are
projected (``weight[columns] @ h + bias[columns]``); every other column gets a
logit of -inf, so the usual softmax normalises over the active tokens only.
When the union is most of the vocabulary the full projection runs and is
masked instead; when it is the whole vocabulary the full projection runs
unchanged, so a file whose active sets cover the vocabulary decodes exactly as
without it.

The same object serves every decoder: the plugin's decoders call it from the
model runner (``ModelRunner.step``); fairseq's own beam search (``--decoder
beam``) calls ``decoder.forward``, so
:func:`fairseq_fastgen.adapters.output_layer.attach_to_stock_generator` routes
that decoder's ``output_layer`` through it while that generator generates.

``--cluster-full-normalizer`` is a diagnostic: the candidates stay the union's
tokens, but the pad column (which every decoder bans after the softmax) takes
the log of the whole probability mass outside the union, so the softmax
normaliser is the full vocabulary's and each active token's log-probability is
the full projection's. It runs the full projection as well, so it is not
faster; it measures how much of the change in output comes from the softmax
over the active tokens alone rather than from the missing tokens.

``--time-projection`` (without a cluster file) puts :class:`TimedFullProjection`
in the same place: the unchanged full projection, timed and counted with the same
statistics, so that the reduced projection's step time has a baseline measured
the same way (fastgen-bench turns it on for the configurations without a file).
"""

import logging
import math
import time
from pathlib import Path
from typing import Dict, NamedTuple, Optional

import torch
from torch import Tensor

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, output_projection_of
from fairseq_fastgen.cluster.directory import Direction, load_for_direction
from fairseq_fastgen.cluster.outside_mass import EstimatedNormalizer
from fairseq_fastgen.ops.cluster_union import ClusterActiveSets, cluster_union_mask
from fairseq_fastgen.ops.onednn_linear import attached_to, linear_like
from fairseq_fastgen.counters import GenerationCounters

logger = logging.getLogger(__name__)

# Above this fraction of the vocabulary, the full projection followed by the -inf
# mask is cheaper than gathering the union's rows of the weight (the gather copies
# the rows before their product).
DENSE_FRACTION = 0.5
# The reduced projection's width is rounded up to one of 8 sizes per octave: a CPU GEMM
# is slower at a width it has not run before, and bucketed widths repeat.
WIDTH_SIZES_PER_OCTAVE = 8


class ProjectionStatistics:
    """Per-step active fraction of the vocabulary and time spent in the projection."""

    def __init__(self):
        self.steps = 0
        self.states = 0
        self.full_vocab_steps = 0  # steps whose union was the whole vocabulary
        self.active_fraction_sum = 0.0
        self.active_fraction_max = 0.0
        self.seconds = 0.0

    def record(self, states: int, active: int, vocab_size: int, seconds: float):
        fraction = active / vocab_size
        self.steps += 1
        self.states += states
        self.full_vocab_steps += int(active == vocab_size)
        self.active_fraction_sum += fraction
        self.active_fraction_max = max(self.active_fraction_max, fraction)
        self.seconds += seconds

    def as_dict(self) -> Dict[str, float]:
        return {
            "projection_steps": self.steps,
            "projection_states": self.states,
            "projection_full_vocab_steps": self.full_vocab_steps,
            "projection_active_fraction_mean": self.active_fraction_sum / self.steps if self.steps else 0.0,
            "projection_active_fraction_max": self.active_fraction_max,
            "projection_seconds": self.seconds,
            "projection_ms_per_step": 1000 * self.seconds / self.steps if self.steps else 0.0,
        }


class TimedFullProjection:
    """The decoder's full vocabulary projection, timed: ``projection(features (rows, n, hidden), decoder)``."""

    def __init__(self):
        self.statistics = ProjectionStatistics()

    def __call__(self, features: Tensor, decoder) -> Tensor:
        start = time.perf_counter()
        linear = output_projection_of(decoder)
        logits, active = self.project(features, linear)  # (rows, n, vocab), active columns
        if features.is_cuda:
            torch.cuda.synchronize(features.device)  # time the work, not its launch
        states = features.numel() // features.size(-1)
        self.statistics.record(states, active, linear.weight.size(0), time.perf_counter() - start)
        return logits

    def project(self, features: Tensor, linear: torch.nn.Linear):
        return linear(features), linear.weight.size(0)


class ClusterProjection(TimedFullProjection):
    """``projection(features (rows, n, hidden), decoder) -> logits (rows, n, vocab)``, on the clusters' tokens."""

    def __init__(self, cluster_file: ClusterFile, normalizer=None, nearest: int = 1):
        """``normalizer``: what puts the mass outside the union into the pad column, ``--cluster-full-normalizer``'s
        FullNormalizer or the file's EstimatedNormalizer (``outside_mass.py``), or None (the softmax over the union);
        ``nearest``: the clusters each state takes the tokens of (``--cluster-nearest``)."""
        super().__init__()
        self.cluster_file = cluster_file
        self.nearest = nearest
        self.vocab_size = cluster_file.fingerprint.vocab_size
        self.normalizer = normalizer
        self._tensors_by_device = {}

    def project(self, features: Tensor, linear: torch.nn.Linear):
        on_device = self._tensors_on(features.device)
        states = features.reshape(-1, features.size(-1))  # (rows * n, hidden)
        if attached_to(linear):  # --onednn-linear: the distances through oneDNN too, as -2 C h + ||C||^2
            distances = linear_like(linear, states.float(), on_device.minus_twice_centroids, on_device.sqnorms)
            clusters = smallest(distances, self.nearest)  # (rows * n,) or (rows * n, nearest)
        else:
            clusters = nearest_clusters(states, on_device.centroids, on_device.sqnorms, self.nearest)
        # (vocab,), (active,)
        mask, columns = cluster_union_mask(clusters.reshape(-1), on_device.active_sets, self.vocab_size)
        logits = project_onto_columns(features, linear, mask, columns)  # (rows, n, vocab)
        if self.normalizer is not None and columns.numel() < self.vocab_size:
            nearest = clusters if clusters.dim() == 1 else clusters[:, 0]  # (rows * n,) each state's nearest
            self.normalizer.put_outside_mass(logits, features, linear, mask, nearest, on_device)
        return logits, columns.numel()

    def _tensors_on(self, device) -> "ClusterTensors":
        if device not in self._tensors_by_device:
            cf = self.cluster_file
            centroids = cf.centroids.to(device)
            estimate = (cf.outside_intercepts.to(device), cf.outside_gradients.to(device)) \
                if cf.has_outside_estimate else (None, None)
            self._tensors_by_device[device] = ClusterTensors(
                centroids, centroids.mul(-2), cf.centroid_sqnorms.to(device),
                ClusterActiveSets(cf.offsets.to(device), cf.tokens.to(device)), *estimate,
            )
        return self._tensors_by_device[device]


class ClusterTensors(NamedTuple):
    """A cluster file's tensors on one device."""

    centroids: Tensor  # (clusters, hidden)
    minus_twice_centroids: Tensor  # (clusters, hidden) -2 C, the weight of the distances through a linear product
    sqnorms: Tensor  # (clusters,) ||C||^2
    active_sets: ClusterActiveSets
    outside_intercepts: Optional[Tensor] = None  # (clusters,) the estimate of the mass outside each set, where held
    outside_gradients: Optional[Tensor] = None  # (clusters, hidden)


class FullNormalizer:
    """``--cluster-full-normalizer``: the pad column of the reduced logits takes the
    log-sum-exp of every full-projection logit outside the union (pad's own included),
    so the softmax's normaliser becomes the full vocabulary's. Decoders ban pad after
    the softmax, so it is never chosen; ``temperature`` is the one the logits are
    divided by before the softmax. It runs the full projection (a second time when the
    union is dense): a diagnostic, not a speedup."""

    def __init__(self, pad: int, temperature: float = 1.0):
        self.pad, self.temperature = pad, temperature

    def put_outside_mass(self, logits: Tensor, features: Tensor, linear: torch.nn.Linear, mask: Tensor,
                         nearest: Tensor = None, file_tensors: "ClusterTensors" = None):
        """logits (rows, n, vocab) edited in place; mask (vocab,) true on the union (``nearest``, ``file_tensors``:
        the estimate's, unused)."""
        kept = mask.clone()  # (vocab,) the union's candidates; pad's own mass joins the outside
        kept[self.pad] = False
        full = linear(features.reshape(-1, features.size(-1))).view_as(logits)  # (rows, n, vocab)
        scaled = full.masked_fill(kept, -math.inf).div_(self.temperature)
        logits[..., self.pad] = scaled.logsumexp(dim=-1).mul_(self.temperature)


def nearest_clusters(states: Tensor, centroids: Tensor, centroid_sqnorms: Tensor, count: int = 1) -> Tensor:
    """Index of the nearest centroid of every state: argmin_c ||C_c||^2 - 2 h.C_c (its ``count`` nearest).

    states (n, hidden) any float dtype, centroids (clusters, hidden) float32,
    centroid_sqnorms (clusters,). Returns (n,) long, or (n, count) nearest first
    where ``count`` > 1. Distances in float32.
    """
    scores = torch.addmm(centroid_sqnorms, states.float(), centroids.t(), alpha=-2)  # (n, clusters)
    return smallest(scores, count)


def smallest(distances: Tensor, count: int) -> Tensor:
    """(n,) the column of each row's smallest entry of ``distances`` (n, clusters); where ``count`` > 1,
    (n, count) the columns of its ``count`` smallest, smallest first."""
    if count == 1:
        return distances.argmin(dim=1)
    return distances.topk(count, dim=1, largest=False).indices


def project_onto_columns(features: Tensor, linear: torch.nn.Linear, mask: Tensor, columns: Tensor) -> Tensor:
    """Logits (rows, n, vocab) of ``linear`` on the union columns only, -inf elsewhere
    (with ``--onednn-linear`` attached to ``linear``, through oneDNN as well).

    features (rows, n, hidden); mask (vocab,) bool, true on the union;
    columns (active,) its ascending token ids.
    """
    vocab_size = linear.weight.size(0)
    if columns.numel() == vocab_size:
        return linear(features)
    if columns.numel() > DENSE_FRACTION * vocab_size:
        # adding a (vocab,) row of 0 / -inf is several times faster than a broadcast masked_fill_
        outside = torch.zeros_like(mask, dtype=features.dtype).masked_fill_(~mask, -math.inf)  # (vocab,)
        return linear(features).add_(outside)
    reduced = columns_product(features, linear, columns)  # (rows, n, active)
    logits = features.new_full((*features.shape[:-1], vocab_size), -math.inf)  # (rows, n, vocab)
    return logits.index_copy_(-1, columns, reduced)


def columns_product(features: Tensor, linear: torch.nn.Linear, columns: Tensor) -> Tensor:
    """``linear``'s logits (rows, n, active) on ``columns`` (active,) only, from their weight rows (through
    oneDNN where ``--onednn-linear`` attached it): features (rows, n, hidden)."""
    active = columns.numel()
    padded = padded_width(active, linear.weight.size(0))
    computed = columns if padded == active else torch.cat([columns, columns[:1].expand(padded - active)])
    weight = linear.weight.index_select(0, computed)  # (padded, hidden)
    bias = None if linear.bias is None else linear.bias.index_select(0, computed)  # (padded,)
    # flattened: fairseq's features are a transposed view, on which a 3-D linear with a weight
    # that needs no grad (this one) runs unfolded, much slower on CPU at many rows
    states = features.reshape(-1, features.size(-1))  # (rows * n, hidden)
    reduced = linear_like(linear, states, weight, bias)[:, :active]  # (rows * n, active)
    return reduced.view(*features.shape[:-1], active)


def padded_width(active: int, vocab_size: int) -> int:
    """``active`` rounded up to the next of WIDTH_SIZES_PER_OCTAVE sizes per power of two (at most vocab_size)."""
    step = 1 << max(0, active.bit_length() - 1 - int(math.log2(WIDTH_SIZES_PER_OCTAVE)))
    return min(vocab_size, -(-active // step) * step)


def load_projection(path, model, normalizer: str = "estimate", direction: Optional[Direction] = None,
                    nearest: int = 1, temperature: float = 1.0) -> ClusterProjection:
    """Read ``path`` (a cluster file, or a directory of them: the file of ``direction``, the run's
    (source, target) languages), check it against ``model``'s vocabulary projection and against
    ``direction``, and return the projection: each state on its ``nearest`` clusters (``--cluster-nearest``),
    normalised as ``normalizer`` says: "estimate" (the default: the file's estimate of the mass outside the
    union, where it holds one and ``temperature`` is 1, else over the union), "union"
    (``--cluster-union-normalizer``) or "full" (``--cluster-full-normalizer``, over the whole vocabulary).

    Raises ClusterFileError for a missing, truncated, corrupted or inconsistent
    file, one made for another model, or one of another direction or target language.
    """
    if Path(path).is_dir():
        cluster_file, path = load_for_direction(path, direction)
        logger.info("--cluster-projection: %s, the clusters of %s", path, cluster_file.serves())
    else:
        cluster_file = ClusterFile.load(path)
    decoder = model.decoder
    cluster_file.check_model(decoder, path)
    if direction is not None:
        cluster_file.check_direction(*direction, path)
    eos = decoder.dictionary.eos() if getattr(decoder, "dictionary", None) is not None else None
    try:
        cluster_file.validate(eos=eos)
    except ClusterFileError as error:
        raise ClusterFileError(f"{path}: {error}") from error
    clusters = cluster_file.centroids.size(0)
    if nearest > clusters:
        raise ClusterFileError(f"--cluster-nearest {nearest}: {path} has {clusters} clusters")
    return ClusterProjection(cluster_file, normalizer_of(normalizer, cluster_file, decoder, temperature, path), nearest)


def normalizer_of(normalizer: str, cluster_file: ClusterFile, decoder, temperature: float, path):
    """The projection's normaliser (``load_projection``'s ``normalizer``): a FullNormalizer, an
    EstimatedNormalizer, or None (over the union), with one line where the estimate cannot serve."""
    pad = decoder.dictionary.pad()
    if normalizer == "full":
        return FullNormalizer(pad, temperature)
    if normalizer == "union":
        return None
    if not cluster_file.has_outside_estimate:
        logger.info("--cluster-projection: %s holds no estimate of the mass outside its tokens (made before "
                    "fastgen-train-clusters fitted one): the softmax is over the active tokens", path)
        return None
    if temperature != 1.0:
        logger.info("--cluster-projection: the estimate of the mass outside the active tokens is of temperature "
                    "1; at --temperature %g the softmax is over the active tokens", temperature)
        return None
    return EstimatedNormalizer(pad)


class ProjectionCounters(GenerationCounters):
    """Counters of a generator whose only plugin statistics are the projection's."""

    def __init__(self, decoder_name, statistics: ProjectionStatistics):
        super().__init__(decoder_name)
        self.statistics = statistics

    def extra_stats(self):
        return self.statistics.as_dict()
