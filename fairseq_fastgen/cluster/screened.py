"""The vocabulary projection screened in int8 (``--screened-projection``): float32's best tokens, a quarter of
its bytes.

At a few rows a decoder step reads its weights once, and the vocabulary projection is the largest of them
(32k x 512 float32 at base size: 65 MB of a step's ~150 MB).  The screen reads an int8 copy instead (one scale
per token row, each state rounded on a scale of its own: ``precision_linear.Int8Rows``, the plugin's kernel) and
bounds its error: for a weight row w (scale s, integers q) and a state h (scale s_h, integers p),

    w.h - s q . s_h p  =  (w - s q).h  +  s q . (h - s_h p),

so |w.h - s q . s_h p| is at most s/2 ||h||_1 + s ||q||_1 s_h/2 (each coordinate's rounding at most half a step)
and at most ||w - s q||_2 ||h||_2 + ||s q||_2 ||h - s_h p||_2 (Cauchy-Schwarz, with the state's own rounding
error, computed as the kernel rounds it); the second is usually the smaller (by about a quarter at base size).
Each estimate lies within ``B(h)``, the smaller of the two, of the float32 logit: the weights' constants are the
largest over the vocabulary (computed once), the state's are computed per state, plus a margin for float32's own
rounding.  A token whose estimate is more than 2B below the m-th best estimate cannot be among the m best logits,
so only the tokens within 2B of it (and the special symbols, which decoders ban or force) are recomputed in
float32 from their weight rows; the others keep their estimates.  The m best tokens of every state are then
float32's (``certified_top``: 1 for greedy and blockwise, the top-k of ``--blockwise-top-k``, 2 x beam for beam
search's candidates), each with float32's logit.

What changes: the softmax's normaliser sums the estimates of the tokens not recomputed, so log-probabilities
differ from float32's by a little (the tokens not recomputed carry little mass); greedy and blockwise keep
float32's tokens, beam search can reorder hypotheses whose scores are that close.  A decoder that bans ordinary
tokens (``--no-repeat-ngram-size``) could pick one that was not recomputed, so that option is refused with it.
"""

from typing import Sequence

import torch
from torch import Tensor

from fairseq_fastgen.cluster.projection import TimedFullProjection, columns_product, DENSE_FRACTION
from fairseq_fastgen.cluster.clusterfile import output_projection_of
from fairseq_fastgen.ops.int8_kernel import INPUT_LEVELS
from fairseq_fastgen.ops.precision_linear import Int8Rows, rounded_inputs, rounded_weight

# float32's rounding in the reference logit and in the estimate's scaling: a few units in the last place of the
# largest terms, taken generously (the bound is far above it anyway)
ROUNDING_MARGIN = 1e-4
# Tokens per chunk whose maxima bound a state's m-th best estimate from below (m > 1): the m-th largest chunk
# maximum is reached by m distinct tokens.  A chunk takes every (vocab // CHUNK)-th token, so that the frequent
# tokens (fairseq's dictionaries put them first) fall into different chunks and the maxima are one vectorised
# pass.  At 320 states of the base model's 32k tokens: 2 ms against 18 for a top-k.
CHUNK = 32


class ScreenedProjection(TimedFullProjection):
    """``projection(features (rows, n, dim), decoder) -> logits (rows, n, vocab)``: int8 estimates, float32 on the
    tokens that could be among the ``certified_top`` best of a state."""

    def __init__(self, special_tokens: Sequence[int], certified_top: int = 1):
        super().__init__()
        self.special = torch.tensor(sorted(set(special_tokens)), dtype=torch.long)  # (specials,)
        self.certified_top = max(1, int(certified_top))
        self.screen = None  # ScreenWeights of the linear it copies, made on the first call

    def project(self, features: Tensor, linear: torch.nn.Linear):
        screen = self.screen_of(linear)
        states = features.reshape(-1, features.size(-1)).float()  # (states, dim)
        estimates = screen.rows(states, linear.bias)  # (states, vocab)
        vocab = estimates.size(1)
        threshold = self.mth_best_ordinary(estimates) - 2 * screen.bound(states)  # (states,) below it: not a best
        # (vocab,) whether a token could be among the m best of any state: the largest margin over the states,
        # taken in place (a subtraction and an addition of the thresholds leave estimates, not exact values)
        margins = estimates.sub_(threshold.unsqueeze(1))
        mask = margins.amax(dim=0).ge(0)
        estimates = margins.add_(threshold.unsqueeze(1))
        mask[self.special] = True
        columns = mask.nonzero().squeeze(1)  # (recomputed,)
        if columns.numel() > DENSE_FRACTION * vocab:
            return linear(features), vocab
        exact = columns_product(features, linear, columns)  # (rows, n, recomputed)
        logits = estimates.view(*features.shape[:-1], vocab)
        return logits.index_copy_(-1, columns, exact.to(logits.dtype)), columns.numel()

    def mth_best_ordinary(self, estimates: Tensor) -> Tensor:
        """At most the m-th best estimate (states,) of each state among the tokens that are not special: the
        maximum where m = 1, else the m-th largest of the chunk maxima (m distinct tokens reach it)."""
        special = estimates.index_select(1, self.special)  # (states, specials), set aside while the maxima run
        estimates.index_fill_(1, self.special, float("-inf"))
        if self.certified_top == 1:
            best = estimates.amax(dim=1)
        else:
            maxima = chunk_maxima(estimates)  # (states, chunks)
            best = (maxima if maxima.size(1) >= self.certified_top else estimates).topk(
                self.certified_top, dim=1).values[:, -1]
        estimates.index_copy_(1, self.special, special)
        return best

    def screen_of(self, linear: torch.nn.Linear) -> "ScreenWeights":
        if self.screen is None or not self.screen.copies(linear.weight):
            self.screen = ScreenWeights(linear.weight)
        return self.screen


def chunk_maxima(estimates: Tensor) -> Tensor:
    """estimates (states, vocab) -> (states, chunks): chunk j's maximum over tokens j, j + chunks, j + 2 chunks, ...
    (CHUNK tokens each, chunks = vocab // CHUNK), then one more chunk of the last vocab % CHUNK tokens."""
    states, vocab = estimates.shape
    chunks = vocab // CHUNK
    whole = chunks * CHUNK
    maxima = estimates[:, :whole].view(states, CHUNK, chunks).amax(dim=1)
    if whole == vocab:
        return maxima
    return torch.cat([maxima, estimates[:, whole:].amax(dim=1, keepdim=True)], dim=1)


class ScreenWeights:
    """The int8 rows of a vocabulary projection's weight (vocab, dim) and the constants of their error bound."""

    def __init__(self, weight: Tensor):
        self.source, self.version = weight, weight._version
        self.rows = Int8Rows(weight)
        weight = weight.detach().float()
        scales = self.rows.scales  # (vocab,) the largest magnitude of each row over 127
        # s/2, and s ||q||_1 / 2 <= (||w||_1 + dim s/2) / 2: the state's two terms of the bound, their largest
        self.half_scale = float(scales.max()) / 2
        self.half_l1 = float((weight.abs().sum(dim=1) + weight.size(1) * scales / 2).max()) / 2
        # ||w - s q||_2 and ||s q||_2, their largest, in float64 (the integers as Int8Rows rounds them)
        integers, _ = rounded_weight(weight)  # (vocab, dim)
        rounded = integers.double() * scales.double().unsqueeze(1)  # (vocab, dim)
        self.residual_l2 = float((weight.double() - rounded).norm(dim=1).max())
        self.rounded_l2 = float(rounded.norm(dim=1).max())
        # float32 sums of dim products (the reference's and the kernel's scaling): dim * 2^-23 of max|w| ||h||_1
        self.rounding = weight.size(1) * 2.0 ** -23 * float(weight.abs().max())

    def bound(self, states: Tensor) -> Tensor:
        """The largest error (states,) of any estimate of states (states, dim), the rounding margin included."""
        magnitudes = states.abs()
        l1, largest = magnitudes.sum(dim=1), magnitudes.amax(dim=1)  # (states,) each
        by_coordinates = self.half_scale * l1 + self.half_l1 * largest / INPUT_LEVELS
        # the state rounded as the kernel rounds it
        exact = states.double()
        integers, steps = rounded_inputs(states)  # (states, dim), (states, 1)
        state_error = (exact - integers.double() * steps.double()).norm(dim=1)  # (states,)
        by_norms = (self.residual_l2 * exact.norm(dim=1) + self.rounded_l2 * state_error).float()
        return torch.minimum(by_coordinates, by_norms) + self.rounding * l1 + ROUNDING_MARGIN

    def copies(self, weight: Tensor) -> bool:
        return weight is self.source and weight._version == self.version


def certified_top(beam: int, blockwise_top_k: int = 0) -> int:
    """How many best tokens of each state the screen gives float32's logits: greedy's and exact blockwise's one,
    ``--blockwise-top-k``'s k, beam search's 2 x beam candidates."""
    return max(2 * beam if beam > 1 else 1, blockwise_top_k or 0)


def check_screen_options(options, gen_cfg):
    """Refuse what ``--screened-projection`` cannot serve among fairseq's generation options (``ValueError``)."""
    if options.screened_projection and (getattr(gen_cfg, "no_repeat_ngram_size", 0) or 0) > 0:
        raise ValueError("--screened-projection keeps float32's best tokens, but --no-repeat-ngram-size bans tokens "
                         "after the projection and could pick one it did not recompute: give one of them")


def screened_projection(model, certified_top: int, options) -> ScreenedProjection:
    """``--screened-projection``'s projection for ``model``; ``ValueError`` where it cannot serve."""
    if options.cluster_projection:
        raise ValueError("--screened-projection and --cluster-projection both replace the vocabulary projection; "
                         "give one of them")
    if options.quantize == "int8" and not options.float32_vocabulary_projection:
        raise ValueError("--screened-projection keeps float32's best tokens; with --quantize int8 the vocabulary "
                         "projection is int8 already (add --float32-vocabulary-projection to screen it)")
    linear = output_projection_of(model.decoder)
    if linear.weight.device.type != "cpu":
        raise ValueError(f"--screened-projection runs on the CPU (int8 products); the model is on "
                         f"{linear.weight.device}: leave the option out")
    dictionary = model.decoder.dictionary
    special = [dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()]
    return ScreenedProjection([t for t in special if 0 <= t < linear.weight.size(0)], certified_top)
