"""One decoder step of a fairseq ``TransformerDecoder`` over preallocated keys/values.

:class:`DecoderStep` reads the parameters of the loaded fairseq decoder itself
(no conversion) and runs the same layer arithmetic as fairseq's incremental
decoder, with the cache in :class:`~fairseq_fastgen.engine.static_cache.StaticCache`
buffers instead of a dict of tensors grown with ``torch.cat``.  Three forms, which
run one layer loop (:meth:`DecoderStep.layer_loop`) and differ in their attention only:

* :meth:`DecoderStep.exact`: every row at the same buffer length, one or several
  new positions per row (blockwise verification); attention reads the filled
  prefix of the buffers, where rows of different real lengths are left-padded
  and masked as fairseq's k-head decoder pads them after a rollback.  The
  products, softmaxes and additions are fairseq's, in fairseq's order and
  layouts, so its features are bitwise fairseq's on the CPU
  (``tests/engine/test_static_engine.py``).  With ``blocks_by_position`` (the
  static engine under ``--quantize int8``) a block's positions attend one by
  one over their own prefix, as one-position steps do: a block's attention
  then sums in the steps' order, so in int8, whose linear layers give each row
  the same bits whatever rows share the call, blockwise verification computes
  bitwise what greedy's steps compute (in float32 the sums of a fused softmax
  over a longer, masked row already differ in the last bits, which int8's
  rounding of each row would magnify into other tokens).
* :meth:`DecoderStep.fast`: the exact form's single-position step in fewer,
  larger calls (one query/key/value product, fused attention over the buffers
  in place), for the compiled engine's eager rows; scores move in the last bits.
* :meth:`DecoderStep.padded`: every shape fixed (rows, buffer capacity, source
  width), each row at its own target position (rows joined at different
  lengths too), one position per row or a block of them (blockwise
  verification); attention runs over the whole buffer with the positions a row
  does not attend (unwritten, or another row's before it took the place)
  masked.  This is the form ``torch.compile`` turns into one compiled unit
  (``compiled.py``); the longer softmax sums in another order, so scores move
  in the last bits.

:func:`unsupported_reason` says why a decoder cannot run here (the runner then
keeps fairseq's own step).
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq import utils
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

from fairseq_fastgen.engine.block_rows import BlockRows


def unsupported_reason(decoder) -> Optional[str]:
    """None when :class:`DecoderStep` computes exactly what ``decoder`` does, else why not."""
    if not isinstance(decoder, TransformerDecoderBase):
        return f"{type(decoder).__name__} is not a fairseq TransformerDecoder"
    if decoder.cross_self_attention:
        return "--cross-self-attention is not supported"
    reason = embeddings_unsupported(decoder)
    if reason:
        return reason
    for layer in decoder.layers:
        if layer.encoder_attn is None:
            return "a decoder without encoder attention is not supported"
        extras = [layer.c_attn, layer.attn_ln, layer.ffn_layernorm, layer.w_resid]
        if any(extra is not None for extra in extras):
            return "NormFormer / head-scale layers are not supported"
        reason = attention_unsupported(layer.self_attn) or attention_unsupported(layer.encoder_attn)
        if reason:
            return reason
    return None


def embeddings_unsupported(coder) -> Optional[str]:
    """Why the embeddings of a fairseq encoder or decoder ``coder`` are not re-stated here, or None."""
    if coder.quant_noise is not None:
        return "quant-noise on the embeddings is not supported"
    if coder.embed_positions is not None and not isinstance(
        coder.embed_positions, (SinusoidalPositionalEmbedding, LearnedPositionalEmbedding)
    ):
        return f"positional embedding {type(coder.embed_positions).__name__} is not supported"
    return None


def attention_unsupported(attention) -> Optional[str]:
    """Why a fairseq ``MultiheadAttention`` is not re-stated here, or None."""
    if attention.bias_k is not None or attention.add_zero_attn or getattr(attention, "use_xformers", False):
        return "attention with bias_kv, zero_attn or xformers is not supported"
    return None


def feed_forward(layer, x: Tensor, fc1=None, fc2=None) -> Tensor:
    """The feed-forward block of a fairseq encoder or decoder layer; ``fc1``/``fc2``: callables in place of the
    layer's own (the compiled engine's reduced-precision layers)."""
    residual = x
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = (fc2 or layer.fc2)(layer.activation_fn((fc1 or layer.fc1)(x)))
    x = layer.residual_connection(x, residual)
    if not layer.normalize_before:
        x = layer.final_layer_norm(x)
    return x


def position_table(embed_positions, length: int) -> Optional[Tensor]:
    """Embedding of every position up to ``length`` of a fairseq positional embedding (None: none), (positions,
    dim), indexed as fairseq does (from padding_idx + 1); a sinusoidal table grows as fairseq's own forward
    grows it."""
    if embed_positions is None:
        return None
    if isinstance(embed_positions, SinusoidalPositionalEmbedding):
        needed = embed_positions.padding_idx + 1 + length
        if needed > embed_positions.weights.size(0):
            embed_positions.weights = SinusoidalPositionalEmbedding.get_embedding(
                needed, embed_positions.embedding_dim, embed_positions.padding_idx
            ).to(embed_positions.weights)
        return embed_positions.weights
    return embed_positions.weight


def token_table(embed_tokens) -> Optional[Tensor]:
    """The token embeddings (vocab, dim) of ``embed_tokens`` where it is a plain ``nn.Embedding`` (else None).
    A compiled unit takes them as an input instead of holding them: frozen, they would be a copy of the
    model's table in every unit (65 MB at base size; with shared embeddings the same table as the vocabulary
    projection, which a unit holds prepacked anyway)."""
    return embed_tokens.weight if type(embed_tokens) is nn.Embedding else None


def embedded(embed_tokens, tokens: Tensor, tokens_table: Optional[Tensor]) -> Tensor:
    """The embeddings (rows, n, dim) of tokens (rows, n): rows of ``tokens_table`` (``token_table``'s), else
    ``embed_tokens``' own forward."""
    return embed_tokens(tokens) if tokens_table is None else F.embedding(tokens, tokens_table)


class DecoderStep(nn.Module):
    """The incremental step of ``decoder`` (shares its parameters)."""

    def __init__(self, decoder, blocks_by_position: bool = False):
        super().__init__()
        self.decoder = decoder
        # a block's positions attend one by one, each as a one-position step would (see exact())
        self.blocks_by_position = blocks_by_position
        self.layers = decoder.layers
        attention = decoder.layers[0].self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.first_head = getattr(decoder, "heads", None)  # transformer_khead: head 1 of its k heads
        # the compiled engine under --quantize: the linear layers in int8 or bfloat16 (layer_weights.LayerWeights),
        # which the fast and padded forms compute through; None: each layer's own forward
        self.reduced = None
        # the exact form's beams (a cache whose sentences' beams share their keys) attend in one product per layer
        # (``attend_beams_together``: sums in another order than fairseq's) instead of one per beam
        self.beams_together = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def with_products(self, reduced: nn.Module) -> "DecoderStep":
        """A step of the same decoder and fused weights whose linear layers compute through ``reduced`` (a
        ``layer_weights.LayerWeights``)."""
        step = DecoderStep(self.decoder, self.blocks_by_position)
        step.fused_buffers = self.fused_buffers
        step.reduced = reduced
        return step

    # ---- inputs -------------------------------------------------------------------------------
    def position_table(self, length: int) -> Optional[Tensor]:
        """Embedding of every target position up to ``length`` (bos included), (positions, dim)."""
        return position_table(self.decoder.embed_positions, length)

    def token_table(self) -> Optional[Tensor]:
        """The token embeddings (vocab, dim), for a compiled unit to read as an input (see ``token_table``)."""
        return token_table(self.decoder.embed_tokens)

    def embed(self, tokens: Tensor, position_rows: Optional[Tensor], tokens_table: Optional[Tensor] = None) -> Tensor:
        """tokens (rows, n); position_rows (rows or 1, n, dim) or None; tokens_table: the token embeddings
        (vocab, dim) as an input, or None (the decoder's own) -> x (n, rows, dim)."""
        decoder = self.decoder
        x = decoder.embed_scale * embedded(decoder.embed_tokens, tokens, tokens_table)  # (rows, n, dim)
        if decoder.project_in_dim is not None:
            x = self.linear(decoder.project_in_dim, x, "project_in_dim")
        if position_rows is not None:
            x += position_rows
        if decoder.layernorm_embedding is not None:
            x = decoder.layernorm_embedding(x)
        return x.transpose(0, 1)

    def finish(self, x: Tensor, first_head: bool = True) -> Tensor:
        """x (n, rows, dim) after the last layer -> features (rows, n, dim) for the output projection
        (``first_head``: through a k-head decoder's head 1)."""
        decoder = self.decoder
        if decoder.layer_norm is not None:
            x = decoder.layer_norm(x)
        x = x.transpose(0, 1)
        if decoder.project_out_dim is not None:
            x = self.linear(decoder.project_out_dim, x, "project_out_dim")
        if first_head and self.first_head is not None:
            heads = self.first_head
            if self.reduced is None or heads.identity_first:
                x = heads.first(x)
            else:  # head 1 is learned: its layers in the reduced precision too
                x = heads.learned(x, lambda h: self.linear(heads.fc1, h, "heads.fc1"),
                                  lambda h: self.linear(heads.fc2, h, "heads.fc2"))[..., 0, :]
        return x

    def linear(self, module: nn.Module, x: Tensor, name: str) -> Tensor:
        """``module(x)`` for the linear layer ``name`` of the decoder (its name among the decoder's modules):
        through its reduced-precision module where ``self.reduced`` holds one."""
        rows = None if self.reduced is None else self.reduced.layer(name)
        return module(x) if rows is None else rows(x)

    def fused_qkv(self, index: int, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """Layer ``index``'s query, key and value projections as one product: x (..., dim) -> (..., 3 * dim),
        ``weight``/``bias`` the fused float32 ones (``fused_weights.py``), reduced-precision ones where
        ``self.reduced`` holds them."""
        rows = None if self.reduced is None else self.reduced.qkv_layer(index)
        return F.linear(x, weight, bias) if rows is None else rows(x)

    def split_heads(self, x: Tensor) -> Tensor:
        """(length, rows, dim) -> (rows * heads, length, head_dim), fairseq's layout."""
        return x.contiguous().view(x.size(0), -1, self.head_dim).transpose(0, 1)

    def encoder_keys_values(self, encoder_states: Tensor, kept: Optional[Tensor] = None,
                            product: Optional[Callable[[Tensor], Tensor]] = None) -> Tuple[list, list]:
        """Per layer, the encoder-decoder keys and values (rows, heads, src_len, head_dim) of
        ``encoder_states`` (src_len, rows, dim), laid out as fairseq's first step leaves them; with ``kept``
        (n,), of those rows only, each layer's projection still over every row (the bits of fairseq's
        product over them: a product over fewer rows sums in another order).  ``product``: every layer's
        projections as one, (src_len, rows, dim) -> (src_len, rows, layers * 2 * dim) in the order of
        ``fused_weights.encoder_key_value_projections`` (then each layer's keys and values are slices of one copy)."""
        rows = encoder_states.size(1)
        if product is not None:
            projected = product(encoder_states)  # (src_len, rows, layers * 2 * dim)
            # (layers, 2, rows, heads, src_len, head_dim): [layer, 0] its keys, [layer, 1] its values
            split = projected.view(projected.size(0), rows, len(self.layers), 2, self.heads, self.head_dim)
            split = split.permute(2, 3, 1, 4, 0, 5)
            both = (split if kept is None else split.index_select(2, kept)).contiguous()
            return list(both[:, 0].unbind(0)), list(both[:, 1].unbind(0))
        keys, values = [], []
        for layer in self.layers:
            attention = layer.encoder_attn
            for projection, kept_layers in ((attention.k_proj, keys), (attention.v_proj, values)):
                projected = self.split_heads(projection(encoder_states)).view(rows, self.heads, -1, self.head_dim)
                kept_layers.append(projected if kept is None else projected.index_select(0, kept))
        return keys, values

    # ---- the layer loop of every form ----------------------------------------------------------------
    def layer_loop(self, x: Tensor, self_attention, encoder_attention) -> Tuple[Tensor, Optional[Tensor]]:
        """x (n, rows, dim) through every layer, as fairseq's decoder layer runs it; the forms differ only in
        their attention: ``self_attention(index, attention module, x)`` -> the heads' output before the module's
        ``out_proj`` (n, rows, dim), its cache written; ``encoder_attention(index, layer, x, need_weights)`` ->
        the encoder-decoder attention block's output (residual and norm included) and, with ``need_weights``
        (the last layer), its weights.  Returns x after the last layer and those weights."""
        attn = None
        for index, layer in enumerate(self.layers):
            x, residual = self.sublayer_input(layer, layer.self_attn_layer_norm, x)
            x = layer.residual_connection(self.linear(layer.self_attn.out_proj, self_attention(index, layer.self_attn, x),
                                                      f"layers.{index}.self_attn.out_proj"), residual)
            if not layer.normalize_before:
                x = layer.self_attn_layer_norm(x)
            last = index == self.num_layers - 1  # its attention weights go into the hypotheses
            x, weights = encoder_attention(index, layer, x, last)
            attn = weights if last else attn
            x = self.feed_forward(layer, x, index)
        return x, attn

    # ---- the exact form -----------------------------------------------------------------------
    def exact(self, tokens: Tensor, position_rows, cache, first_head: bool = True) -> Tuple[Tensor, Tensor]:
        """Features (rows, n, dim) and the last layer's encoder attention (rows, n, src_len) of ``n`` new
        positions per row: tokens (rows, n), position_rows (rows or 1, n, dim) or None.

        The rows write positions ``cache.length`` .. ``cache.length + n - 1`` of their buffers; new position
        j attends to the earlier positions not marked in ``cache.self_padding`` and to new positions <= j
        (fairseq's causal mask, added as fairseq adds it); ``cache.length`` then grows by n.  One position
        is an incremental step; several are a blockwise verification (``forward_block`` of
        transformer_khead).  ``first_head``: a k-head decoder's output goes through head 1 (as its
        ``extract_features``); else the base output (as its ``forward_block``).
        """
        rows, n, start = tokens.size(0), tokens.size(1), cache.length
        end = start + n
        x = self.embed(tokens, position_rows)  # (n, rows, dim)
        causal = None  # (n, end): -inf where a new position would see a later one
        if n > 1:
            causal = torch.cat([x.new_zeros(n, start), utils.fill_with_neg_inf(x.new_zeros(n, n)).triu(1)], dim=1)
        padding = cache.attended_padding(n)  # (rows, end) or None

        def self_attention(index: int, attention, x: Tensor) -> Tensor:
            q = attention.q_proj(x)
            k = attention.k_proj(x)
            v = attention.v_proj(x)
            q *= attention.scaling
            q = self.split_heads(q)  # (rows * heads, n, head_dim)
            key_buffer, value_buffer = cache.self_keys[index], cache.self_values[index]  # (rows, heads, cap, hd)
            key_buffer[:, :, start:end] = k.view(n, rows, self.heads, self.head_dim).permute(1, 2, 0, 3)
            value_buffer[:, :, start:end] = v.view(n, rows, self.heads, self.head_dim).permute(1, 2, 0, 3)
            # the written positions read in place, a batch of (end, head_dim) matrices a row capacity apart: the
            # same bits as a contiguous copy's products (tests/engine/test_static_engine.py, on the CPUs seen
            # here) without copying every cached position at every step
            written = (rows * self.heads, end, self.head_dim)
            keys = key_buffer[:, :, :end].reshape(written)  # a view: rows and heads merge
            values = value_buffer[:, :, :end].reshape(written)
            if n > 1 and self.blocks_by_position:
                x = torch.cat([self.attend(q[:, j:j + 1], keys[:, :start + j + 1], values[:, :start + j + 1],
                                           None, None if padding is None else padding[:, :start + j + 1])[0]
                               for j in range(n)], dim=1)  # (rows * heads, n, head_dim)
            else:
                x, _ = self.attend(q, keys, values, causal, padding)  # (rows * heads, n, head_dim)
            return self.merge_heads(x, rows)

        def encoder_attention(index: int, layer, x: Tensor, need_weights: bool):
            return self.exact_encoder_attention(layer, x, index, cache, need_weights)

        x, weights = self.layer_loop(x, self_attention, encoder_attention)
        attn = weights.view(rows, self.heads, n, -1).transpose(1, 0).mean(dim=0)  # (rows, n, src_len)
        cache.length = end
        return self.finish(x, first_head), attn

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, causal: Optional[Tensor] = None,
               padding: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """q (rows * heads, n, head_dim) over keys and values (rows * heads, end, head_dim), ``causal`` (n, end)
        added and ``padding`` (rows, end) masked as fairseq does: the result (rows * heads, n, head_dim) and the
        weights (rows * heads, n, end)."""
        n, end = q.size(1), keys.size(1)
        weights = torch.bmm(q, keys.transpose(1, 2))  # (rows * heads, n, end)
        if causal is not None:
            weights += causal.unsqueeze(0)
        if padding is not None:
            weights = weights.view(-1, self.heads, n, end).masked_fill(
                padding[:, None, None, :], float("-inf")
            ).view(-1, n, end)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32)
        return torch.bmm(weights, values), weights

    def exact_encoder_attention(self, layer, x, index, cache, need_weights: bool):
        n, rows = x.size(0), x.size(1)
        residual = x
        if layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        attention = layer.encoder_attn
        q = attention.q_proj(x)
        q *= attention.scaling
        q = self.split_heads(q)  # (rows * heads, n, head_dim)
        sources = cache.cross_keys[index].size(0)  # rows, or sentences whose beams share their keys
        keys = cache.cross_keys[index].view(sources * self.heads, -1, self.head_dim)  # (sources * heads, src, hd)
        values = cache.cross_values[index].view(sources * self.heads, -1, self.head_dim)
        if cache.beams > 1:
            attend = self.attend_beams_together if self.beams_together else self.attend_per_beam
            x, weights = attend(q, keys, values, cache.cross_mask, cache.beams)
        elif n > 1 and self.blocks_by_position:
            attended = [self.attend(q[:, j:j + 1], keys, values, padding=cache.cross_mask) for j in range(n)]
            x, weights = (torch.cat(parts, dim=1) for parts in zip(*attended))
        else:
            x, weights = self.attend(q, keys, values, padding=cache.cross_mask)
        x = self.merge_heads(x, rows)
        x = layer.residual_connection(attention.out_proj(x), residual)
        if not layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        return x, (weights if need_weights else None)

    def attend_per_beam(self, q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], beams: int):
        """One position of rows that are sentences x ``beams`` (each sentence's beams together), q
        (rows * heads, 1, head_dim), over keys and values held once per sentence (sentences * heads, src_len,
        head_dim), ``mask`` (sentences, src_len): one product per beam, each beam's query against its
        sentence's keys as fairseq multiplies it against its own copy (the same bits; a product over the
        beams at once sums in another order).  The result and weights are laid out as ``attend``'s."""
        sentences = keys.size(0) // self.heads
        per_beam = q.view(sentences, beams, self.heads, 1, self.head_dim).transpose(0, 1)
        per_beam = per_beam.reshape(beams, sentences * self.heads, 1, self.head_dim)  # beam-major
        outputs = [self.attend(per_beam[beam], keys, values, padding=mask) for beam in range(beams)]
        x, weights = (torch.stack(parts).view(beams, sentences, self.heads, 1, -1).transpose(0, 1)
                      .reshape(sentences * beams * self.heads, 1, -1) for parts in zip(*outputs))
        return x, weights  # (rows * heads, 1, head_dim), (rows * heads, 1, src_len)

    def attend_beams_together(self, q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], beams: int):
        """``attend_per_beam``'s result and weights in one product per layer: each sentence's beams are the ``beams``
        query positions of one (beams, head_dim) x (head_dim, src_len) product against its keys (at 320 rows,
        beam 5, one product's fixed cost instead of five; the sums run in another order than fairseq's)."""
        sentences = keys.size(0) // self.heads
        together = q.view(sentences, beams, self.heads, self.head_dim).transpose(1, 2)  # (sentences, heads, beams, hd)
        x, weights = self.attend(together.reshape(sentences * self.heads, beams, self.head_dim), keys, values,
                                 padding=mask)  # (sentences * heads, beams, head_dim), (sentences * heads, beams, src)
        return tuple(t.view(sentences, self.heads, beams, -1).transpose(1, 2).reshape(sentences * beams * self.heads,
                                                                                     1, -1) for t in (x, weights))

    @staticmethod
    def sublayer_input(layer, norm, x: Tensor) -> Tuple[Tensor, Tensor]:
        """The input of a sublayer (through ``norm`` first when the layer normalizes before) and its residual."""
        return (norm(x) if layer.normalize_before else x), x

    def merge_heads(self, x: Tensor, rows: int) -> Tensor:
        """(rows * heads, n, head_dim) -> (n, rows, dim), fairseq's layout."""
        return x.transpose(0, 1).contiguous().view(x.size(1), rows, self.heads * self.head_dim)

    def feed_forward(self, layer, x: Tensor, index: int) -> Tensor:
        """The feed-forward block of layer ``index``."""
        if self.reduced is None:
            return feed_forward(layer, x)
        return feed_forward(layer, x, lambda h: self.linear(layer.fc1, h, f"layers.{index}.fc1"),
                            lambda h: self.linear(layer.fc2, h, f"layers.{index}.fc2"))

    # ---- the fast form (one position per row, every row at the same length) -------------------------
    def fast(self, last_tokens: Tensor, position_rows, cache, qkv_product) -> Tuple[Tensor, Tensor]:
        """The exact form's step (features (rows, 1, dim), attention (rows, 1, src_len)) in fewer, larger
        calls: each self-attention's query, key and value as one product (``qkv_product(layer index, x)``
        -> (1, rows, 3 * dim)) and attention through ``scaled_dot_product_attention`` over the written
        positions of the buffers, read in place.  Sums run in other orders: the same tokens, scores within
        float rounding (the compiled engine's promise).  Rows must not hold left padding."""
        rows, position = last_tokens.size(0), cache.length
        x = self.embed(last_tokens, position_rows)  # (1, rows, dim)
        dim = self.heads * self.head_dim
        mask = cache.cross_mask  # (rows, src_len) True at padding
        if mask is None:
            mask = cache.cross_keys[0].new_zeros((rows, cache.cross_keys[0].size(2)), dtype=torch.bool)

        def self_attention(index: int, attention, x: Tensor) -> Tensor:
            q, k, v = qkv_product(index, x)[0].split(dim, dim=-1)  # (rows, dim) each
            key_buffer, value_buffer = cache.self_keys[index], cache.self_values[index]  # (rows, heads, cap, hd)
            key_buffer[:, :, position] = k.view(rows, self.heads, self.head_dim)
            value_buffer[:, :, position] = v.view(rows, self.heads, self.head_dim)
            q = (q * attention.scaling).view(rows, self.heads, 1, self.head_dim)
            return F.scaled_dot_product_attention(
                q, key_buffer[:, :, : position + 1], value_buffer[:, :, : position + 1], scale=1.0
            ).view(1, rows, dim)

        def encoder_attention(index: int, layer, x: Tensor, need_weights: bool):
            return self.encoder_attention(index, layer, x, cache.cross_keys[index], cache.cross_values[index], mask,
                                          need_weights)

        x, attn = self.layer_loop(x, self_attention, encoder_attention)
        cache.length = position + 1
        return self.finish(x), attn

    # ---- the padded form (fixed shapes, a position per row, or a block of them) -----------------------
    def padded(self, last_tokens: Tensor, positions: Tensor, attended: Tensor, position_table: Optional[Tensor],
               self_keys, self_values, cross_keys, cross_values, cross_mask: Tensor, qkv_weights, qkv_biases,
               beams: int = 1, first_head: bool = True, tokens_table: Optional[Tensor] = None):
        """Features (rows, 1, dim), last-layer encoder attention (rows, src_width) and the new self-attention
        keys and values of every layer (rows, heads, head_dim) of one step.

        last_tokens (rows, 1); positions (rows,) each row's target position (its target length so far: rows
        joined at different lengths each have their own); attended (rows, cap) True at the buffer positions
        each row reads besides its new one (its earlier positions, not those of rows that held its place
        before); self_keys/values per layer (rows, heads, cap, hd), read at the attended positions (the caller
        writes the new ones at the buffers' length afterwards: a pure function compiles into tighter loops
        than one that updates its inputs); cross_keys/values per layer (rows, heads, src_width, hd); cross_mask
        (rows, src_width) True at padding; qkv_weights/biases per layer, each self-attention's query, key
        and value projections as one (``fused_weights.py``).  With ``beams`` > 1 the rows are sentences x
        beams (each sentence's beams together) and the encoder-decoder keys/values and mask hold one entry
        per sentence (sentences, ...), shared by its beams.  tokens_table: the token embeddings as an input
        (``token_table``), or None.

        A block (blockwise verification): last_tokens and positions (rows, n), n > 1, each new position
        attending the ``attended`` ones and the block's positions up to itself; then features (rows, n, dim),
        attention (rows, n, src_width) and new keys/values (rows, heads, n, head_dim).  ``first_head``: a
        k-head decoder's output through head 1 (False: the base output, as ``step_block`` returns it).
        """
        block_rows = None  # blocks_by_position: the block's positions as rows of one position (block_rows.py)
        if last_tokens.size(1) > 1 and self.blocks_by_position:
            block_rows = BlockRows(attended, last_tokens.size(1))
            last_tokens, positions, attended = last_tokens.reshape(-1, 1), positions.reshape(-1), block_rows.attended
            cross_keys, cross_values = block_rows.repeated_all(cross_keys), block_rows.repeated_all(cross_values)
            cross_mask = block_rows.repeated(cross_mask)
        rows, n = last_tokens.size(0), last_tokens.size(1)
        position_rows = None
        if position_table is not None:
            index = positions if n > 1 else positions.unsqueeze(1)  # (rows, n)
            position_rows = position_table[index + (self.decoder.padding_idx + 1)]  # (rows, n, dim)
        x = self.embed(last_tokens, position_rows, tokens_table)  # (n, rows, dim)
        new_keys, new_values = [], []  # per layer

        def self_attention(index: int, attention, x: Tensor) -> Tensor:
            q, k, v = self.fused_qkv(index, x, qkv_weights[index], qkv_biases[index]).chunk(3, dim=-1)  # (n, rows, dim) each
            if n == 1:
                q = (q * attention.scaling).view(rows, self.heads, 1, self.head_dim)
                k, v = k.view(rows, self.heads, 1, self.head_dim), v.view(rows, self.heads, 1, self.head_dim)
                new_keys.append(k.view(rows, self.heads, self.head_dim))
                new_values.append(v.view(rows, self.heads, self.head_dim))
                keys, values = self_keys[index], self_values[index]
                if block_rows is not None:  # each position's row: the block's keys/values before it in their slots
                    keys = block_rows.buffer_with_block(keys, new_keys[-1])
                    values = block_rows.buffer_with_block(values, new_values[-1])
                return self.attention_with_new_position(q, keys, values, attended, k, v)
            q, k, v = (self.heads_first(t) for t in (q * attention.scaling, k, v))  # (rows, heads, n, hd)
            new_keys.append(k)
            new_values.append(v)
            return self.attention_with_new_block(q, self_keys[index], self_values[index], attended, k, v)

        def encoder_attention(index: int, layer, x: Tensor, need_weights: bool):
            return self.encoder_attention(index, layer, x, cross_keys[index], cross_values[index], cross_mask,
                                          need_weights=need_weights, beams=beams)

        x, weights = self.layer_loop(x, self_attention, encoder_attention)
        attn = weights[:, 0] if n == 1 else weights  # (rows, src_width) / (rows, n, src_width)
        features = self.finish(x, first_head)
        if block_rows is not None:  # back to the block's shapes
            features = features.view(block_rows.rows, block_rows.n, -1)  # (rows, n, dim)
            attn = attn.view(block_rows.rows, block_rows.n, -1)  # (rows, n, src_width)
            new_keys, new_values = ([block_rows.per_row(new) for new in news] for news in (new_keys, new_values))
        return features, attn, new_keys, new_values

    def heads_first(self, x: Tensor) -> Tensor:
        """(n, rows, dim) -> (rows, heads, n, head_dim)."""
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).permute(1, 2, 0, 3)

    def encoder_attention(self, index: int, layer, x, keys, values, mask, need_weights: bool, beams: int = 1):
        """The encoder-decoder attention block of the fast and padded forms: x (1, rows, dim) over keys/values
        (rows, heads, src_len, hd), ``mask`` (rows, src_len) True at padding -> x (1, rows, dim) and, with
        ``need_weights``, the attention weights averaged over the heads (rows, 1, src_len), else None.  With
        ``beams`` > 1 the rows are sentences x beams and keys/values/mask hold one entry per sentence: a
        sentence's beams are the queries of one product over its keys."""
        n, rows = x.size(0), x.size(1)
        residual = x
        if layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        attention = layer.encoder_attn
        q = self.linear(attention.q_proj, x, f"layers.{index}.encoder_attn.q_proj") * attention.scaling
        if n > 1:  # a block of positions per row (no beams): the row's queries
            x, weights = self.masked_attention(self.heads_first(q), keys, values, mask)  # (rows, heads, n, ...)
            x = x.view(rows, n, self.heads * self.head_dim).transpose(0, 1)
            weights = weights.mean(dim=1) if need_weights else None  # (rows, n, src_len)
        elif need_weights or beams > 1:
            q = q.view(-1, beams, self.heads, self.head_dim).transpose(1, 2)
            x, weights = self.masked_attention(q, keys, values, mask)
            weights = weights.mean(dim=1).reshape(rows, 1, -1)  # (rows, 1, src_len)
        else:
            q, weights = q.view(-1, beams, self.heads, self.head_dim).transpose(1, 2), None
            x = F.scaled_dot_product_attention(q, keys, values, attn_mask=~mask[:, None, None, :], scale=1.0)
            x = x.view(1, rows, self.heads * self.head_dim)
        x = layer.residual_connection(self.linear(attention.out_proj, x, f"layers.{index}.encoder_attn.out_proj"),
                                      residual)
        if not layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        return x, weights

    def attention_with_new_position(self, q, keys, values, attended, new_key, new_value):
        """q (rows, heads, 1, hd) over the ``attended`` (rows, cap) positions of keys/values (rows, heads,
        cap, hd) and the new position's key/value (rows, heads, 1, hd) -> (1, rows, dim).

        The scores of the buffer's positions and of the new one are computed apart and share one softmax,
        so the buffers are read in place, never copied with the new position appended; inductor fuses the
        masking, the softmax and both weighted sums into its loops, which is faster at every row count than
        appending the new position and calling ``scaled_dot_product_attention``.
        The scaling is already in ``q``."""
        rows = q.size(0)
        buffer_scores = torch.matmul(q, keys.transpose(2, 3))  # (rows, heads, 1, cap)
        buffer_scores = buffer_scores.masked_fill(~attended[:, None, None, :], float("-inf"))
        new_scores = (q * new_key).sum(dim=-1, keepdim=True)  # (rows, heads, 1, 1)
        weights = F.softmax(torch.cat([buffer_scores, new_scores], dim=-1), dim=-1)  # (rows, heads, 1, cap + 1)
        x = torch.matmul(weights[..., :-1], values) + weights[..., -1:] * new_value  # (rows, heads, 1, hd)
        return x.reshape(rows, 1, self.heads * self.head_dim).transpose(0, 1)

    def attention_with_new_block(self, q, keys, values, attended, new_keys, new_values):
        """``attention_with_new_position`` for a block of n new positions: q, new_keys/values (rows, heads, n,
        hd), each new position reading the ``attended`` (rows, cap) buffer positions and the block's positions
        up to itself -> (n, rows, dim)."""
        rows, n = q.size(0), q.size(2)
        buffer_scores = torch.matmul(q, keys.transpose(2, 3))  # (rows, heads, n, cap)
        buffer_scores = buffer_scores.masked_fill(~attended[:, None, None, :], float("-inf"))
        later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # (n, n) a later position of the block
        block_scores = torch.matmul(q, new_keys.transpose(2, 3)).masked_fill(later, float("-inf"))  # (.., n, n)
        weights = F.softmax(torch.cat([buffer_scores, block_scores], dim=-1), dim=-1)  # (rows, heads, n, cap + n)
        capacity = keys.size(2)
        x = torch.matmul(weights[..., :capacity], values) + torch.matmul(weights[..., capacity:], new_values)
        return x.permute(2, 0, 1, 3).reshape(n, rows, self.heads * self.head_dim)

    def masked_attention(self, q, keys, values, masked):
        """q (n, heads, queries, hd) over keys/values (n, heads, width, hd), ``masked`` (n, width) True where a
        key is not attended -> (1, n x queries, dim) and the weights (n, heads, queries, width)."""
        scores = torch.matmul(q, keys.transpose(2, 3)).masked_fill(masked[:, None, None, :], float("-inf"))
        weights = F.softmax(scores, dim=-1, dtype=torch.float32)
        x = torch.matmul(weights, values)  # (n, heads, queries, hd)
        return x.transpose(1, 2).reshape(1, -1, self.heads * self.head_dim), weights
