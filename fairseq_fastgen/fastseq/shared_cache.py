"""Encoder-decoder attention keys/values kept once per sentence, shared by its beams.

Stock fairseq beam search (``SequenceGenerator``) repeats the encoder output of
each of the B sentences once per beam (``reorder_encoder_out`` with
``arange(B).repeat_interleave(M)``) and keeps it so until the end; every
encoder-decoder attention then projects and caches B*M identical copies of the
keys/values, reads all of them at every step, and copies them
(``index_select``) whenever finished sentences leave the batch.

With the shared cache (:func:`share_encoder_cache`):

* the encoder output stays (src_len, B, C); the ensemble's
  ``reorder_encoder_out`` only drops sentences when finished ones leave the batch;
* each encoder-decoder attention caches its keys/values once per sentence,
  (B, heads, src_len, head_dim), never copied when beams reorder, and shrunk by
  fairseq's own per-sentence path (``MultiheadAttention.beam_size``, which
  stock fairseq switches on only for BART) when sentences leave the batch;
* the M beams of a sentence attend to that single copy
  (:class:`SharedEncoderAttention`: the models' encoder-decoder attention
  modules are switched to this subclass, which behaves as its parent for
  every call that is not shared, so other generators on the same models are
  unaffected).

Exactness: fairseq's BART path attends with one einsum whose matrix product
covers the M beams at once; on this CPU that changes the last bits of the
attention (MKL sums a 1-row and an M-row product in different orders), so
scores drift from stock beam search by ~1e-6.  Here every beam's query is
multiplied with its own ``bmm`` call against the shared keys/values, the same
1-row product stock fairseq computes against its copy.  Likewise the first
step projects the encoder output of every beam, as stock does, and keeps one
copy (a transient freed at once): a projection over B rows instead of B*M
gives other last bits when B*src_len is small.  Tokens and scores are then
bitwise those of stock beam search (``tests/fastseq/test_shared_cache.py``).
"""

import contextlib
from typing import Dict, List, Optional

import torch
from fairseq import utils
from fairseq.models.transformer import TransformerDecoderBase, TransformerModelBase
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

IncrementalState = Dict[str, Dict[str, Optional[torch.Tensor]]]


class BeamSharedAttention(MultiheadAttention):
    """fairseq's MultiheadAttention with a second path for keys/values held once per sentence.

    :meth:`shared_step` returns the attention output (and weights) of the calls
    a subclass serves from its per-sentence keys/values, and None for every
    other call, which is then the parent's, unchanged.
    """

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        incremental_state=None,
        need_weights=True,
        static_kv=False,
        attn_mask=None,
        before_softmax=False,
        need_head_weights=False,
    ):
        shared = self.shared_step(
            query, key, key_padding_mask, incremental_state, static_kv, attn_mask, before_softmax,
            need_weights or need_head_weights, need_head_weights,
        )
        if shared is not None:
            return shared
        return super().forward(
            query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
            attn_mask, before_softmax, need_head_weights,
        )

    def shared_step(self, query, key, key_padding_mask, incremental_state, static_kv, attn_mask, before_softmax,
                    need_weights, need_head_weights):
        raise NotImplementedError


class SharedEncoderAttention(BeamSharedAttention):
    """Encoder-decoder attention whose beams attend to keys/values held once per sentence.

    The shared path runs while a sharing generator decodes (it sets fairseq's
    ``beam_size`` to M for the duration of its calls), for one incremental
    step of encoder-decoder attention whose keys/values (the encoder output at
    the first step, the cache afterwards) have one row per sentence: queries
    (1, B*M, C), the M beams of a sentence adjacent as SequenceGenerator keeps
    them; keys/values of B sentences.  Every other call is the parent's,
    unchanged.
    """

    def shared_step(self, query, key, key_padding_mask, incremental_state, static_kv, attn_mask, before_softmax,
                    need_weights, need_head_weights):
        sentences = self._shared_sentences(query, key, incremental_state, static_kv, attn_mask, before_softmax)
        if sentences is None:
            return None
        return self._attend_shared(
            query, key, key_padding_mask, incremental_state, sentences, need_weights, need_head_weights,
        )

    def _shared_sentences(self, query, key, incremental_state, static_kv, attn_mask, before_softmax):
        """The number of sentences whose keys/values the beams share, or None for a stock call."""
        if self.beam_size < 2 or incremental_state is None or not static_kv:
            return None
        if attn_mask is not None or before_softmax or query.size(0) != 1:
            return None
        cached = self._get_input_buffer(incremental_state)
        if "prev_key" in cached:
            sentences = cached["prev_key"].size(0)
        elif key is not None:
            sentences = key.size(1)
        else:
            return None
        return sentences if sentences * self.beam_size == query.size(1) else None

    def _attend_shared(self, query, key, key_padding_mask, incremental_state, sentences, need_weights, need_head_weights):
        _, rows, embed_dim = query.size()  # query: (1, sentences * beams, embed_dim)
        beams = self.beam_size
        heads, head_dim = self.num_heads, self.head_dim
        keys, values, padding = self._sentence_keys_values(key, key_padding_mask, incremental_state, beams)
        src_len = keys.size(2)
        keys_t = keys.view(sentences * heads, src_len, head_dim).transpose(1, 2)  # (sentences * heads, head_dim, src_len)
        values = values.view(sentences * heads, src_len, head_dim)

        queries = self.q_proj(query)
        queries *= self.scaling
        # beam-major, so that each beam's rows are one contiguous block
        queries = queries.view(sentences, beams, embed_dim).transpose(0, 1).reshape(beams, sentences * heads, 1, head_dim)
        # one 1-row product per beam and head, as stock fairseq computes against its per-beam copy
        weights = queries.new_empty(beams, sentences * heads, 1, src_len)
        for beam in range(beams):
            torch.bmm(queries[beam], keys_t, out=weights[beam])
        if padding is not None:
            weights.view(beams, sentences, heads, 1, src_len).masked_fill_(
                padding.view(1, sentences, 1, 1, src_len).to(torch.bool), float("-inf")
            )
        weights_float = utils.softmax(weights, dim=-1)  # (beams, sentences * heads, 1, src_len)
        probs = self.dropout_module(weights_float.type_as(weights))
        attended = queries.new_empty(beams, sentences * heads, 1, head_dim)
        for beam in range(beams):
            torch.bmm(probs[beam], values, out=attended[beam])
        attended = attended.view(beams, sentences, embed_dim).transpose(0, 1).reshape(1, rows, embed_dim)
        output = self.out_proj(attended)
        if not need_weights:
            return output, None
        # (heads, rows, 1, src_len), laid out as stock fairseq's so that the mean over heads adds alike
        head_weights = (
            weights_float.view(beams, sentences, heads, 1, src_len)
            .transpose(0, 1)
            .contiguous()
            .view(rows, heads, 1, src_len)
            .transpose(1, 0)
        )
        if need_head_weights:
            return output, head_weights
        return output, head_weights.mean(dim=0)

    def _sentence_keys_values(self, key, key_padding_mask, incremental_state, beams):
        """(sentences, heads, src_len, head_dim) keys and values, and the (sentences, src_len) padding mask:
        from the cache, or projected from the encoder output (src_len, sentences, C) and cached."""
        cached = self._get_input_buffer(incremental_state)
        if "prev_key" not in cached:
            src_len, sentences, _ = key.size()
            keys = self._project_as_stock(self.k_proj, key, beams)
            values = self._project_as_stock(self.v_proj, key, beams)
            cached["prev_key"] = keys.view(sentences, self.num_heads, src_len, self.head_dim)
            cached["prev_value"] = values.view(sentences, self.num_heads, src_len, self.head_dim)
            # stored as stock fairseq stores it (float), so its reorder and any reader see the same state
            cached["prev_key_padding_mask"] = None if key_padding_mask is None else key_padding_mask.float()
            self._set_input_buffer(incremental_state, cached)
        return cached["prev_key"], cached["prev_value"], cached["prev_key_padding_mask"]

    def _project_as_stock(self, projection, encoder_out, beams):
        """(sentences * heads, src_len, head_dim): ``projection`` of the encoder output
        (src_len, sentences, C), computed over every beam's copy as stock fairseq does,
        keeping one.  A product over ``sentences`` rows instead of ``sentences * beams``
        gives other last bits on this CPU (MKL blocks its sums by row count)."""
        src_len, sentences, _ = encoder_out.size()
        per_beam = encoder_out.repeat_interleave(beams, dim=1)  # (src_len, sentences * beams, C), freed on return
        projected = projection(per_beam).view(src_len, sentences, beams, self.embed_dim)[:, :, 0]
        split_heads = (src_len, sentences * self.num_heads, self.head_dim)
        return projected.contiguous().view(split_heads).transpose(0, 1)


def supports_shared_cache(model) -> bool:
    """Whether every use ``model`` makes of the encoder output is an encoder-decoder
    attention that :class:`SharedEncoderAttention` can serve.

    Transformer models (and subclasses keeping the stock decoder layers, such as
    transformer_khead) qualify; models with their own beam-size mechanism
    (BART), cross-self-attention, or attention variants (extra bias key/value,
    zero attention, xformers) do not.  Not detected: a decoder subclass that
    reads the encoder output in an overridden ``forward`` or ``output_layer``
    (it would get one row per sentence there).
    """
    if not isinstance(model, TransformerModelBase) or hasattr(model, "set_beam_size"):
        return False
    layers = stock_decoder_layers(model.decoder)
    return layers is not None and all(plain_attention(layer.encoder_attn, SharedEncoderAttention) for layer in layers)


def stock_decoder_layers(decoder) -> Optional[List[TransformerDecoderLayerBase]]:
    """The layers of a decoder that runs them as the stock transformer decoder does
    (its own feature extraction and layer forward, no cross-self-attention), else None."""
    if not isinstance(decoder, TransformerDecoderBase) or decoder.cross_self_attention:
        return None
    if type(decoder).extract_features_scriptable is not TransformerDecoderBase.extract_features_scriptable:
        return None
    layers = list(decoder.layers)
    for layer in layers:
        if not isinstance(layer, TransformerDecoderLayerBase) or type(layer).forward is not TransformerDecoderLayerBase.forward:
            return None
    return layers


def plain_attention(attention, shared_class) -> bool:
    """Whether ``attention`` is stock multi-head attention (or already ``shared_class``)
    without the variants a shared path does not serve (extra bias key/value, zero
    attention, xformers, ONNX tracing)."""
    if attention is None or type(attention) not in (MultiheadAttention, shared_class):
        return False
    return not (attention.bias_k is not None or attention.add_zero_attn or attention.use_xformers
                or attention.onnx_trace)


def encoder_attention_modules(model) -> List[MultiheadAttention]:
    return [layer.encoder_attn for layer in model.decoder.layers if layer.encoder_attn is not None]


class _BeamSharing:
    """A generator's EnsembleModel methods, for encoder state held once per sentence.

    SequenceGenerator reorders with ``new_order`` over the B*M beam rows: the
    initial per-beam expansion, beam reorders (beams move only within their
    sentence) and, when sentences finish, the rows of the remaining ones.
    Only the last changes per-sentence state: sentence ``new_order[s*M] // M``.
    The decoder runs and the caches reorder with the attention modules'
    ``beam_size`` set to M, which switches on the shared path and fairseq's
    per-sentence cache reorder, for these calls only: the models stay stock
    for every other user.
    """

    def __init__(self, ensemble: EnsembleModel, beams: int, attention_modules: List[MultiheadAttention]):
        self.beams = beams
        self.attention_modules = attention_modules
        self.original_classes = [type(module) for module in attention_modules]  # what unshare_encoder_cache restores
        self.reorder_all_encoder_outs = ensemble.reorder_encoder_out
        self.reorder_all_incremental_states = ensemble.reorder_incremental_state
        self.forward_all_decoders = ensemble.forward_decoder

    def reorder_encoder_out(self, encoder_outs, new_order):
        sentences = encoder_outs[0]["encoder_out"][0].size(1)
        if new_order.numel() == sentences * self.beams:
            return encoder_outs
        return self.reorder_all_encoder_outs(encoder_outs, new_order.view(-1, self.beams)[:, 0] // self.beams)

    def reorder_incremental_state(self, incremental_states: List[IncrementalState], new_order):
        with self._sharing():
            self.reorder_all_incremental_states(incremental_states, new_order)

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        with self._sharing():
            return self.forward_all_decoders(tokens, encoder_outs, incremental_states, temperature)

    def _sharing(self):
        return encoder_keys_shared_by_beams(self.attention_modules, self.beams)


@contextlib.contextmanager
def encoder_keys_shared_by_beams(attention_modules: List[MultiheadAttention], beams: int):
    """Inside the block, ``attention_modules`` (a model's encoder-decoder attention, which
    :func:`supports_shared_cache` accepts) serve fairseq's beam search with ``beams`` beams per sentence from
    keys/values held once per sentence: :class:`SharedEncoderAttention` with fairseq's ``beam_size`` set to
    ``beams`` (its per-sentence cache reorder included).  Afterwards each module has its class and a
    ``beam_size`` of 1 again: the model is stock for every other user between the calls."""
    classes = [type(module) for module in attention_modules]
    for module in attention_modules:
        module.__class__ = SharedEncoderAttention
        module.beam_size = beams
    try:
        yield
    finally:
        for module, original in zip(attention_modules, classes):
            module.__class__ = original
            module.beam_size = 1


def share_encoder_cache(generator) -> bool:
    """Make a stock SequenceGenerator keep the encoder output and the encoder-decoder
    keys/values once per sentence; returns whether it did.

    Nothing changes for beam 1, for generators other than SequenceGenerator
    (and its subclasses), or when any model of the ensemble does not
    :func:`supports_shared_cache`.  The models' encoder-decoder attention
    modules become :class:`SharedEncoderAttention` (same parameters, stock
    behaviour for every call that is not shared), so other generators built on
    the same models are unaffected.
    """
    found = stock_beam_ensemble(generator)
    if found is None:
        return False
    ensemble, beams = found
    if shares_encoder_cache(generator):
        return True
    if not ensemble.has_incremental_states() or not all(supports_shared_cache(m) for m in ensemble.models):
        return False
    attention_modules = [module for model in ensemble.models for module in encoder_attention_modules(model)]
    sharing = _BeamSharing(ensemble, beams, attention_modules)
    for module in attention_modules:
        module.__class__ = SharedEncoderAttention
    ensemble.reorder_encoder_out = sharing.reorder_encoder_out
    ensemble.reorder_incremental_state = sharing.reorder_incremental_state
    ensemble.forward_decoder = sharing.forward_decoder
    return True


def unshare_encoder_cache(generator) -> bool:
    """Undo :func:`share_encoder_cache`: the ensemble's methods and the models' attention modules as they were;
    returns whether there was anything to undo."""
    if not shares_encoder_cache(generator):
        return False
    ensemble = generator.model
    sharing = ensemble.reorder_encoder_out.__self__
    for module, original in zip(sharing.attention_modules, sharing.original_classes):
        module.__class__ = original
    for name in ("reorder_encoder_out", "reorder_incremental_state", "forward_decoder"):
        delattr(ensemble, name)  # the instance attributes that shadowed the class's methods
    return True


def shares_encoder_cache(generator) -> bool:
    """Whether :func:`share_encoder_cache` switched ``generator`` to the shared cache."""
    reorder = getattr(getattr(generator, "model", None), "reorder_encoder_out", None)
    return isinstance(getattr(reorder, "__self__", None), _BeamSharing)


def stock_beam_ensemble(generator):
    """``(ensemble, beams)`` of a stock SequenceGenerator (or subclass) searching with 2 or more beams over
    fairseq's decoder step, else None (an ensemble whose steps an engine runs shares keys in its own cache)."""
    ensemble = getattr(generator, "model", None)
    beams = getattr(generator, "beam_size", 1)
    if not isinstance(generator, SequenceGenerator) or not isinstance(ensemble, EnsembleModel) or beams < 2:
        return None
    if type(ensemble).forward_decoder is not EnsembleModel.forward_decoder:
        return None
    return ensemble, beams


def attention_cache_bytes(modules_of, models, incremental_states: List[IncrementalState]) -> int:
    """Bytes held in ``incremental_states`` (one state per model, as SequenceGenerator keeps them)
    by the caches of the attention modules ``modules_of(model)`` returns."""
    total = 0
    for model, state in zip(models, incremental_states):
        for module in modules_of(model):
            for tensor in module._get_input_buffer(state).values():
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
    return total


def encoder_attention_cache_bytes(models, incremental_states: List[IncrementalState]) -> int:
    """Bytes held by the encoder-decoder attention caches (keys, values, padding masks)."""
    return attention_cache_bytes(encoder_attention_modules, models, incremental_states)
