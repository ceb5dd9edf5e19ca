"""The encoder of a fairseq ``TransformerEncoder`` as one pure function of the source tokens.

:class:`EncoderPass` reads the loaded encoder's own parameters (no conversion) and computes what its
``forward`` computes for inference (no dropout, no hidden states kept): embeddings and positions, every
layer's self-attention over the non-padding positions and feed-forward block, the final layer norm.  Written
as one function of the tokens and the position table, it is what the compiled engine exports and compiles
ahead of time (``aot_step.py``), so that a source is encoded by one call instead of fairseq's hundred Python-
dispatched operations, whose dispatch dominates the encoder's time at batch 1.  Attention runs through
``scaled_dot_product_attention`` and the padding positions' outputs are not read by any decoder: the states
of real positions agree with fairseq's within float rounding.

Under ``--quantize int8`` the pass holds the encoder's linear layers as int8 rows (``int8_weights.Int8Weights``, each
self-attention's query, key and value rows as one product, as the decoder's units do) and the unit computes through
the plugin's int8 kernel: the products' bits are those of --quantize's stand-ins in fairseq's own encoder.

:func:`unsupported_encoder_reason` says why an encoder cannot run here (fairseq's own then runs).
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq.models.transformer import TransformerEncoderBase
from fairseq_fastgen.engine.decoder_step import (
    DecoderStep, attention_unsupported, embedded, embeddings_unsupported, feed_forward, position_table, token_table,
)
from fairseq_fastgen.engine.fused_weights import fused_query_key_value
from fairseq_fastgen.engine.int8_weights import Int8Weights
from fairseq_fastgen.engine.layer_weights import LayerWeights


def unsupported_encoder_reason(encoder) -> Optional[str]:
    """None when :class:`EncoderPass` computes what ``encoder`` does at inference, else why not."""
    if not isinstance(encoder, TransformerEncoderBase):
        return f"{type(encoder).__name__} is not a fairseq TransformerEncoder"
    reason = embeddings_unsupported(encoder)
    if reason:
        return reason
    for layer in encoder.layers:
        reason = attention_unsupported(layer.self_attn)
        if reason:
            return reason
        if getattr(layer, "return_fc", False):
            return "encoder layers returning their feed-forward output are not supported"
    return None


def int8_layers(encoder) -> LayerWeights:
    """The linear layers of ``encoder`` as int8 rows, its self-attentions' query/key/value fused."""
    return Int8Weights(encoder, *fused_query_key_value(encoder.layers), float32_vocabulary=False)


class EncoderPass(nn.Module):
    """``encoder``'s inference forward (shares its parameters); ``reduce``: encoder -> its linear layers in a reduced
    precision (``int8_layers``), which the pass then computes through, or None (float32)."""

    def __init__(self, encoder, reduce: Optional[Callable[[nn.Module], LayerWeights]] = None):
        super().__init__()
        self.encoder = encoder
        attention = encoder.layers[0].self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.reduce = reduce
        self.reduced = None  # made from the weights the first unit is built for (follow_weights)

    def follow_weights(self):
        """The encoder's parameters are new or changed: its reduced-precision layers made from them."""
        if self.reduce:
            self.reduced = self.reduce(self.encoder)

    def linear(self, module: nn.Module, x: Tensor, name: str) -> Tensor:
        """``module(x)`` for the encoder's linear layer ``name``, through its reduced-precision module where held."""
        rows = None if self.reduced is None else self.reduced.layer(name)
        return module(x) if rows is None else rows(x)

    def position_table(self, src_len: int) -> Optional[Tensor]:
        """Embedding of every source position up to ``src_len``, (positions, dim)."""
        return position_table(self.encoder.embed_positions, src_len)

    def token_table(self) -> Optional[Tensor]:
        """The token embeddings (vocab, dim), for a compiled unit to read as an input (``token_table``)."""
        return token_table(self.encoder.embed_tokens)

    def forward(self, src_tokens: Tensor, position_table: Optional[Tensor],
                tokens_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """src_tokens (rows, src_len), left- or right-padded; tokens_table: the token embeddings as an input, or
        None (the encoder's own) -> states (src_len, rows, dim) and the padding mask (rows, src_len), True at
        padding (fairseq's ``encoder_out`` and ``encoder_padding_mask``)."""
        encoder = self.encoder
        padding = src_tokens.eq(encoder.padding_idx)  # (rows, src_len)
        real = ~padding
        x = encoder.embed_scale * embedded(encoder.embed_tokens, src_tokens, tokens_table)  # (rows, src_len, dim)
        if position_table is not None:
            # fairseq's make_positions: the real tokens numbered from padding_idx + 1, padding at padding_idx
            positions = torch.cumsum(real.long(), dim=1) * real + encoder.padding_idx
            x = x + position_table[positions]
        if encoder.layernorm_embedding is not None:
            x = encoder.layernorm_embedding(x)
        x = (x * real.unsqueeze(-1).type_as(x)).transpose(0, 1)  # (src_len, rows, dim), padding zeroed
        attended = real[:, None, None, :]  # (rows, 1, 1, src_len)
        for index, layer in enumerate(encoder.layers):
            x, residual = DecoderStep.sublayer_input(layer, layer.self_attn_layer_norm, x)
            x = layer.residual_connection(self.self_attention(index, layer.self_attn, x, attended), residual)
            if not layer.normalize_before:
                x = layer.self_attn_layer_norm(x)
            x = feed_forward(layer, x, lambda h: self.linear(layer.fc1, h, f"layers.{index}.fc1"),
                             lambda h: self.linear(layer.fc2, h, f"layers.{index}.fc2"))  # a decoder layer's block
        if encoder.layer_norm is not None:
            x = encoder.layer_norm(x)
        return x, padding

    def self_attention(self, index: int, attention, x: Tensor, attended: Tensor) -> Tensor:
        """x (src_len, rows, dim) of layer ``index`` attending its ``attended`` (rows, 1, 1, src_len) positions ->
        (src_len, rows, dim), through the layer's output projection."""
        src_len, rows, dim = x.shape
        split = lambda t: t.reshape(src_len, rows, self.heads, self.head_dim).permute(1, 2, 0, 3)  # noqa: E731
        fused = None if self.reduced is None else self.reduced.qkv_layer(index)
        if fused is None:
            q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)  # (src_len, rows, dim) each
        else:
            q, k, v = fused(x).split(dim, dim=-1)  # one product: each output row's int8 scale is its own
        q, k, v = split(q * attention.scaling), split(k), split(v)  # (rows, heads, src_len, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attended, scale=1.0)  # (rows, heads, src_len, hd)
        return self.linear(attention.out_proj, y.permute(2, 0, 1, 3).reshape(src_len, rows, dim),
                           f"layers.{index}.self_attn.out_proj")
