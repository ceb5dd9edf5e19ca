"""Blockwise proposals from int8 weights, on the CPU (``--blockwise-int8-proposals``).

Blockwise decoding verifies every proposed token with head 1 in full
precision; where the proposals of heads 2..k come from is free.  At small
batches on the CPU their products are slow: the k-head layer is k x ffn_dim
wide, and MKL's fp32 product onto the vocabulary costs at 3 rows about what
3 one-row products cost.  An int8 product (``precision_linear.Int8Rows``, the
plugin's kernel or fbgemm's) reads a quarter of the bytes and costs about the
same at 1 and 3 rows (docs/benchmarks.md, "At batch 1 (base size)").

Exact acceptance keeps greedy's output whatever the proposals are (a token
int8 rounding changed is rejected by head 1); the approximate criteria accept
unverified or near-miss proposals, so with them int8 may change the output.

The int8 copies follow the model: they are made again when a weight they
copy has changed in place (an optimizer step bumps the tensor's version), so
a generator built once (validation during training) does not propose from
stale weights.  Writes through ``weight.data`` bypass the version counter;
in exact mode a stale copy costs speed, never output.

With ``tokens`` (``--blockwise-proposal-vocab``), the vocabulary projection holds only those tokens' rows: an
iteration reads N rows of it instead of the vocabulary's, and the other tokens' logits are -inf (never proposed).
"""

import math
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_fastgen.ops.precision_linear import Int8Rows


class Int8Linear:
    """``F.linear(x, weight, bias)`` with weight rounded to int8, one scale per output row, and each input row
    rounded on a scale of its own (``--quantize int8``'s product)."""

    def __init__(self, weight: Tensor, bias=None):
        self.rows = Int8Rows(weight)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: Tensor) -> Tensor:
        """x: (..., in) float -> (..., out) float."""
        return self.rows(x, self.bias)


class Int8Proposer:
    """int8 copies of what makes the proposals of heads 2..k of a ``KHeadTransformerDecoder``: ``fc1`` and
    ``fc2`` of its identity-first ``KHeadLayer`` (the runner's ``int8_later_heads`` computes heads 2..k with
    them) and ``logits(h)``, the vocabulary projection (..., vocab) of head features h (..., dim).
    """

    def __init__(self, decoder, layers=None, tokens: Optional[Tensor] = None):
        """``layers``: the int8 layers the compiled engine's units read under --quantize int8
        (``int8_weights.Int8Weights``), whose rows it uses where they hold them instead of copies of its own: the
        same bits (a row's int8 product does not depend on the kernel), and one copy of the vocabulary's rows
        read per iteration instead of two.  ``tokens`` (N,) long, ascending: the only tokens proposed (their
        rows of the projection copied in int8), or None: every token."""
        heads = decoder.heads
        if decoder.output_projection is None or getattr(decoder, "adaptive_softmax", None) is not None:
            raise ValueError("--blockwise-int8-proposals needs a decoder with a plain output projection "
                             "(this one uses an adaptive softmax)")
        device = decoder.output_projection.weight.device
        if device.type != "cpu":
            raise ValueError(f"--blockwise-int8-proposals runs on the CPU (fbgemm's int8 linear); the model is on "
                             f"{device}: leave the option out")
        self.decoder, self.layers, self.tokens = decoder, layers, tokens
        self.sources = self.copied_weights(decoder)
        self.versions = [weight._version for weight in self.sources]

        def int8_layer(name: str, linear):  # the units' layer where they hold it, else a copy of its own
            shared = None if layers is None else layers.layer(name)
            return Int8Linear(linear.weight, linear.bias) if shared is None else shared

        try:
            if tokens is None:
                self.output = int8_layer("output_projection", decoder.output_projection)
            else:  # each row's int8 scale is its own: the same rows as the whole projection's, fewer of them
                self.output = Int8Linear(decoder.output_projection.weight.detach().index_select(0, tokens))
                self.vocab = decoder.output_projection.weight.size(0)
            self.fc1 = self.fc2 = None  # without identity-first, every head is computed in full precision anyway
            if heads.identity_first and heads.fc1 is not None:
                self.fc1 = int8_layer("heads.fc1", heads.fc1)
                self.fc2 = int8_layer("heads.fc2", heads.fc2)
        except (RuntimeError, AttributeError) as error:  # no int8 engine for this CPU, or a torch without them
            raise ValueError(f"--blockwise-int8-proposals: torch cannot make an int8 linear here ({error})") from error

    @staticmethod
    def copied_weights(decoder) -> List[Tensor]:
        heads = decoder.heads
        layers = [decoder.output_projection]
        if heads.identity_first and heads.fc1 is not None:
            layers += [heads.fc1, heads.fc2]
        return [p for layer in layers for p in (layer.weight, layer.bias) if p is not None]

    def is_current(self, decoder) -> bool:
        """True while the model still holds the weights this proposer copied, on the CPU."""
        weights = self.copied_weights(decoder)
        return (decoder is self.decoder and len(weights) == len(self.sources) and weights[0].device.type == "cpu"
                and all(w is s and w._version == v for w, s, v in zip(weights, self.sources, self.versions)))

    def serves(self, decoder, layers, tokens: Optional[Tensor]) -> bool:
        """Whether this proposer is the one to use for ``decoder`` with ``layers`` and ``tokens``."""
        same_tokens = tokens is self.tokens or (tokens is not None and self.tokens is not None
                                                and torch.equal(tokens, self.tokens))
        return layers is self.layers and same_tokens and self.is_current(decoder)

    def logits(self, features: Tensor) -> Tensor:
        """features (..., dim) -> logits (..., vocab); -inf outside ``tokens`` where given."""
        if self.tokens is None:
            return self.output(features)
        some = self.output(features)  # (..., N)
        logits = some.new_full((*some.shape[:-1], self.vocab), -math.inf)  # (..., vocab)
        return logits.index_copy_(logits.dim() - 1, self.tokens, some)
