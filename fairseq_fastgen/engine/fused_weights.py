"""Weights the compiled step reads in a faster layout, derived from the decoder's own parameters.

At a few rows a decoder step is a chain of matrix-vector products, each bound
by reading its weight, plus a fixed cost per call.  Two layouts save both:

* the query, key and value projections of each self-attention as one
  (3 x dim, dim) product instead of three calls;
* the vocabulary projection's weight stored transposed, (dim, vocab)
  contiguous: MKL's matrix-vector product reads it faster than
  ``F.linear``'s transposed view of the (vocab, dim) weight;
* every layer's encoder-decoder key and value projections as one product
  (``encoder_keys_values``), computed once per sentence.

The copies are made once and made again when a parameter they come from
changes (a new tensor, or an in-place update: its version counter), so a
generator built once keeps serving a model that trains between decodes.
The products sum in another order than fairseq's, so only the compiled
engine (scores within float rounding) reads them.
"""

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from fairseq.models.transformer import TransformerDecoderBase


class FusedWeights(NamedTuple):
    qkv_weights: List[Tensor]  # per layer (3 * dim, dim): query, key, value rows
    qkv_biases: List[Optional[Tensor]]  # per layer (3 * dim,) or None
    output_t: Optional[Tensor]  # (dim, vocab) the vocabulary projection transposed; None: the decoder's own


def tensors_signature(tensors) -> tuple:
    """(identity, in-place version) of every tensor: it changes when one is replaced or updated in place."""
    return tuple((id(t), t._version) for t in tensors)


class FusedWeightsCache:
    """:class:`FusedWeights` of one decoder, rebuilt when its source parameters change."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.signature = None
        self.weights: Optional[FusedWeights] = None

    def sources(self) -> List[Tensor]:
        projections = [p for layer in self.decoder.layers
                       for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)]
        projections += encoder_key_value_projections(self.decoder)
        tensors = [t for p in projections for t in (p.weight, p.bias) if t is not None]
        projection = plain_output_projection(self.decoder)
        if projection is not None:
            tensors.append(projection.weight)
        return tensors

    def current(self) -> FusedWeights:
        """The fused weights of the decoder's parameters as they are now."""
        signature = tensors_signature(self.sources())
        if signature != self.signature:
            self.weights, self.signature = self.build(), signature
        return self.weights

    @torch.no_grad()
    def build(self) -> FusedWeights:
        weights, biases = fused_query_key_value(self.decoder.layers)
        projection = plain_output_projection(self.decoder)
        output_t = projection.weight.t().contiguous() if projection is not None else None
        return FusedWeights(weights, biases, output_t)


@torch.no_grad()
def fused_query_key_value(layers) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
    """Per fairseq encoder or decoder layer, its self-attention's query, key and value rows as one weight (3 * dim,
    dim) and one bias (3 * dim,) or None."""
    fused = [fused_linears((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
             for layer in layers]
    return [weight for weight, _ in fused], [bias for _, bias in fused]


@torch.no_grad()
def fused_linears(projections) -> Tuple[Tensor, Optional[Tensor]]:
    """The rows of several ``nn.Linear`` of one input size as one weight (sum of outputs, in) and one bias (zeros
    for a layer without one), or None where none has a bias."""
    weight = torch.cat([p.weight for p in projections])
    has_bias = [p.bias is not None for p in projections]
    if not any(has_bias):
        return weight, None
    return weight, torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                              for p in projections])


def encoder_key_value_projections(decoder) -> List[nn.Linear]:
    """Every decoder layer's encoder-decoder key and value projections, in the order of
    ``DecoderStep.encoder_keys_values``'s one product: layer 0's keys, its values, layer 1's keys, ..."""
    layers = [layer.encoder_attn for layer in decoder.layers if getattr(layer, "encoder_attn", None) is not None]
    return [projection for attention in layers for projection in (attention.k_proj, attention.v_proj)]


def plain_output_projection(decoder) -> Optional[nn.Linear]:
    """The bias-free ``nn.Linear`` that fairseq's ``output_layer`` applies, or None when the decoder
    projects otherwise (adaptive softmax, an ``output_layer`` of its own or attached to it)."""
    projection = getattr(decoder, "output_projection", None)
    own_output_layer = "output_layer" in decoder.__dict__ or type(decoder).output_layer is not TransformerDecoderBase.output_layer
    if (own_output_layer or decoder.adaptive_softmax is not None
            or not isinstance(projection, nn.Linear) or projection.bias is not None):
        return None
    return projection


class FusedBuffers(nn.Module):
    """:class:`FusedWeights` as the buffers of a module, where inductor's freezing reads constants."""

    def __init__(self, fused: FusedWeights):
        super().__init__()
        self.layers = len(fused.qkv_weights)
        for index, (weight, bias) in enumerate(zip(fused.qkv_weights, fused.qkv_biases)):
            self.register_buffer(f"qkv_weight_{index}", weight)
            self.register_buffer(f"qkv_bias_{index}", bias)
        self.register_buffer("output_t", fused.output_t)

    def weights(self) -> FusedWeights:
        return FusedWeights([getattr(self, f"qkv_weight_{i}") for i in range(self.layers)],
                            [getattr(self, f"qkv_bias_{i}") for i in range(self.layers)], self.output_t)
