"""The softmax mass outside a cluster's active tokens, estimated (the cluster projection's default normaliser).

The cluster projection computes logits on the union of the active tokens of a batch's states only.  Normalised over
that union, every log-probability of a state is raised by the log of its share of the mass that the union misses; on
a trained base that share is often a few percent (median 3% at beam 5 batch 64), and it differs from state to state,
so beam search compares hypotheses of different rows on scores that are off by different amounts.

For a state ``h`` nearest to cluster ``c`` (centroid ``mu``, active tokens ``A``), the log of the mass outside ``A``,

    m(h) = log sum_{t not in A} exp(w_t . h + b_t),

is a convex function of ``h``.  Its first-order expansion at ``mu`` is ``m(mu) + g . (h - mu)``, where ``g`` is the
mean of the outside tokens' weight rows under their softmax at ``mu``.  ``fastgen-train-clusters`` stores per cluster
the expansion as an intercept and a gradient (``e(h) = intercept + g . h``), the intercept raised by the mean of what
the expansion misses on the cluster's member states (convexity puts the expansion below ``m``), shrunk towards the
mean over all clusters where a cluster has few members.

Decoding puts ``e(h)`` into the pad column of the logits, which decoders ban after the softmax: the softmax then
normalises over the union's tokens and the estimated mass outside the state's own cluster (the union's tokens of other
clusters are counted twice, a small excess: computing the own cluster's mass apart to remove it cost 2-3 ms a step at
beam 5 batch 64 and did no better).  One gather of the gradients and a product a state: on the base trained on the
Zen 5, over 34,430 states of beam 5 batch 64, the log normaliser's mean error fell from 0.066 (over the union) to
0.021, and of 1,000 sentences 95.5% came out as with the full projection, against 91.6% (BLEU +0.01, against -0.25).
"""

import math
from typing import Tuple

import torch
from torch import Tensor

from fairseq_fastgen.ops.cluster_union import ClusterActiveSets  # the file's active sets, to fit the estimate

# states whose exact outside mass fits the intercepts' correction: a sample, evenly spaced, of the clustered ones
FIT_STATES = 20000
# a cluster's correction is the mean of its members' remainders and this many times the overall mean, over their count
SHRINK_MEMBERS = 5
STATES_PER_CHUNK = 512  # states whose full logits are computed at once


def fit_outside_mass(states: Tensor, assignment: Tensor, centroids: Tensor, active_sets: ClusterActiveSets,
                     weight: Tensor, bias) -> Tuple[Tensor, Tensor]:
    """(intercepts (clusters,), gradients (clusters, hidden)) of every cluster's estimate of its outside mass.

    states (n, hidden) float32 and their clusters ``assignment`` (n,); centroids (clusters, hidden); ``weight``
    (vocab, hidden) and ``bias`` (vocab,) or None: the output projection's."""
    outside = outside_masks(active_sets, centroids.size(0), weight.size(0))  # (clusters, vocab) true outside A
    at_centroids = masked_logits(centroids, weight, bias, outside)  # (clusters, vocab), -inf on A
    gradients = at_centroids.softmax(dim=-1) @ weight  # (clusters, hidden)
    intercepts = at_centroids.logsumexp(dim=-1) - (gradients * centroids).sum(dim=-1)  # (clusters,)
    sample = torch.linspace(0, states.size(0) - 1, min(FIT_STATES, states.size(0))).long()
    remainders = torch.cat([
        exact_log_outside(states[chunk], weight, bias, outside[assignment[chunk]])
        - estimated_log_outside(intercepts, gradients, assignment[chunk], states[chunk])
        for chunk in sample.split(STATES_PER_CHUNK)
    ])  # (sampled,) m(h) - e(h) before the correction, at least 0 up to rounding
    members = assignment[sample]
    clusters = centroids.size(0)
    sums = torch.zeros(clusters, dtype=torch.float64).index_add_(0, members, remainders.double())
    counts = torch.zeros(clusters, dtype=torch.float64).index_add_(0, members, torch.ones_like(remainders.double()))
    overall = remainders.double().mean()
    corrections = (sums + SHRINK_MEMBERS * overall) / (counts + SHRINK_MEMBERS)  # (clusters,)
    return (intercepts + corrections.float()).contiguous(), gradients.contiguous()


def outside_masks(active_sets: ClusterActiveSets, clusters: int, vocab_size: int) -> Tensor:
    """(clusters, vocab) bool: true on the tokens outside each cluster's active set."""
    sizes = active_sets.offsets.diff()  # (clusters,)
    rows = torch.repeat_interleave(torch.arange(clusters), sizes)  # (nnz,)
    outside = torch.ones(clusters, vocab_size, dtype=torch.bool)
    outside[rows, active_sets.tokens] = False
    return outside


def masked_logits(states: Tensor, weight: Tensor, bias, keep: Tensor) -> Tensor:
    """Logits (n, vocab) of ``states`` (n, hidden), -inf where ``keep`` (n, vocab) is false."""
    logits = states.float() @ weight.float().t()
    if bias is not None:
        logits += bias.float()
    return logits.masked_fill_(~keep, -math.inf)


def exact_log_outside(states: Tensor, weight: Tensor, bias, outside: Tensor) -> Tensor:
    """(n,) the log of each state's mass outside its cluster's tokens (``outside``, (n, vocab))."""
    return masked_logits(states, weight, bias, outside).logsumexp(dim=-1)


class EstimatedNormalizer:
    """The default normaliser of a file that holds the estimate: the pad column of the reduced logits takes each
    state's estimated log mass outside its cluster's tokens, ``e(h)`` (of the model's own logits: temperature 1)."""

    def __init__(self, pad: int):
        self.pad = pad

    def put_outside_mass(self, logits: Tensor, features: Tensor, linear, mask: Tensor, nearest: Tensor,
                         file_tensors):
        """logits (rows, n, vocab) edited in place; features (rows, n, hidden); nearest (rows * n,) each state's
        nearest cluster; ``file_tensors``: the projection's ClusterTensors on this device, with the estimate
        (``linear``, ``mask``: unused)."""
        states = features.reshape(-1, features.size(-1)).float()  # (states, hidden)
        outside = estimated_log_outside(file_tensors.outside_intercepts, file_tensors.outside_gradients, nearest,
                                        states)  # (states,) e(h)
        logits.view(-1, logits.size(-1))[:, self.pad] = outside.to(logits.dtype)


def estimated_log_outside(intercepts: Tensor, gradients: Tensor, clusters: Tensor, states: Tensor) -> Tensor:
    """(n,) e(h) = intercept + gradient . h of each state (n, hidden) of ``clusters`` (n,): intercepts (clusters,),
    gradients (clusters, hidden)."""
    return intercepts[clusters] + (gradients[clusters] * states).sum(dim=-1)
