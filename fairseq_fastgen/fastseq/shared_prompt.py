"""Self-attention keys/values of a language model's prompt kept once per sentence, shared by its beams.

Stock fairseq decodes a ``transformer_lm`` prompt (fairseq-interactive, the hub
interface: ``LanguageModelingTask.inference_step`` passes the prompt as
``prefix_tokens``) by forcing it token by token over all B*M beam rows.  Only
the first beam of each sentence holds the prompt: beam search extends beam 0
alone at step 0 and, the prompt token being the only finite choice, fills the
other M-1 beams with arbitrary tokens of score -inf, which keep that score
until the prompt ends.  Every self-attention layer still computes and caches
keys/values for all B*M rows, (B*M, heads, t, head_dim), concatenates and
reorders (``index_select``) them at every step, and keeps them to the end.

With the shared prompt (:func:`share_prompt_cache`):

* while every remaining sentence is still inside its forced prompt (steps
  0..P, P the shortest prompt of the batch, checked on the token buffer:
  beam 0 of each sentence must hold the prompt), the decoder runs on beam 0 of
  each sentence only, B rows, and its output is given to the M beams: beam
  search then sees the stock scores, since the other beams' rows only ever add
  to a score of -inf;
* the self-attention caches hold those P+1 positions once per sentence,
  ``prefix_key``/``prefix_value`` (B, heads, P+1, head_dim), reordered only
  when finished sentences leave the batch (sentence ``new_order[s*M] // M``);
  the positions after them are cached per beam as stock fairseq does,
  ``prev_key``/``prev_value`` (B*M, heads, t-P-1, head_dim);
* a beam's query attends to both parts, one softmax over all of them
  (:class:`SharedPromptAttention`: the models' self-attention modules are
  switched to this subclass, which is its parent for every call whose cache
  has no prefix part, so other generators on the same models are unaffected).

Exactness: not bitwise.  Positional scores agree with stock beam search to a
few 1e-6 (``tests/fastseq/test_shared_prompt.py`` asserts 1e-5 and the stock
tokens; a near-tie between two candidates could still order them otherwise).
Two things change the last bits on CPU: the prompt steps multiply B rows
instead of B*M (MKL rounds products of few rows differently: a Linear over 1
or 3 rows differs in the last bit from the same rows within 4 or 12), and
attention adds the prefix part and the beam's own part of ``probs @ values``
as two products.  Keeping stock's bits would mean running the prompt over
every beam and concatenating a per-beam copy of the prefix at every step,
which is what this module exists to avoid.

Limitations: stock ``BeamSearch`` and ``Sampling`` only (other searches may
extend beams other than beam 0 during the prompt); decoder-only
``TransformerLanguageModel`` with stock layers and attention (see
:func:`supports_shared_prompt`).  Only the positions shared by every sentence
of the batch (its shortest prompt, up to its first eos) are shared; sentences
with longer prompts decode the rest of theirs per beam, as stock fairseq does.
Sharing stops early if beam 0 of a sentence does not hold its prompt, which
happens only when the forced token itself scores -inf (e.g. banned by
``--no-repeat-ngram-size``): every beam then scores -inf, whatever the decoder
computes (stock fairseq then fails its own ``step < max_len`` assertion).
"""

from typing import Dict, List, Optional

import torch
from fairseq import search, utils
from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq.modules import MultiheadAttention
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from fairseq_fastgen.fastseq.shared_cache import (
    BeamSharedAttention,
    attention_cache_bytes,
    plain_attention,
    stock_beam_ensemble,
    stock_decoder_layers,
)

IncrementalState = Dict[str, Dict[str, Optional[torch.Tensor]]]

SHARED_SEARCHES = (search.BeamSearch, search.Sampling)


class SharedPromptAttention(BeamSharedAttention):
    """Self-attention whose beams attend to prompt keys/values held once per sentence.

    The shared path runs for an incremental step whose cache has a prefix part
    (``prefix_key``, ``prefix_value``, ``prefix_key_padding_mask``: one row per
    sentence), which only a sharing generator's states have: queries
    (1, B*M, C), the M beams of a sentence adjacent as SequenceGenerator keeps
    them; the beam's own positions cached per beam in ``prev_key``/``prev_value``.
    Every other call is the parent's, unchanged.
    """

    def shared_step(self, query, key, key_padding_mask, incremental_state, static_kv, attn_mask, before_softmax,
                    need_weights, need_head_weights):
        cached = self._get_input_buffer(incremental_state) if incremental_state is not None else {}
        if "prefix_key" not in cached:
            return None
        # the decoder passes a padding mask only when it feeds pad, which SequenceGenerator never does
        masked = key_padding_mask is not None or cached.get("prefix_key_padding_mask") is not None
        if query.size(0) != 1 or masked or attn_mask is not None or before_softmax:
            raise NotImplementedError("shared prompt attention serves one incremental step without masks")
        return self._attend_with_prefix(query, incremental_state, need_weights, need_head_weights)

    def _attend_with_prefix(self, query, incremental_state, need_weights, need_head_weights):
        _, rows, embed_dim = query.size()  # query: (1, sentences * beams, embed_dim)
        heads, head_dim = self.num_heads, self.head_dim
        cached = self._get_input_buffer(incremental_state)
        prefix_keys, prefix_values = cached["prefix_key"], cached["prefix_value"]  # (sentences, heads, prefix, head_dim)
        sentences, _, prefix_len, _ = prefix_keys.size()
        beams = rows // sentences

        queries = self.q_proj(query)
        queries *= self.scaling
        own_keys, own_values = self._append_own_keys_values(query, cached, rows)  # (rows, heads, own, head_dim)
        self._set_input_buffer(incremental_state, cached)
        own_len = own_keys.size(2)

        # the M beams of a sentence as M query rows against its prefix: (sentences * heads, beams, prefix)
        by_sentence = queries.view(sentences, beams, heads, head_dim).transpose(1, 2).reshape(
            sentences * heads, beams, head_dim
        )
        prefix_scores = torch.bmm(by_sentence, prefix_keys.view(sentences * heads, prefix_len, head_dim).transpose(1, 2))
        prefix_scores = prefix_scores.view(sentences, heads, beams, prefix_len).transpose(1, 2)
        # each beam against its own positions: (rows * heads, 1, own)
        by_beam = queries.view(rows * heads, 1, head_dim)
        own_scores = torch.bmm(by_beam, own_keys.view(rows * heads, own_len, head_dim).transpose(1, 2))

        weights = torch.cat(
            [prefix_scores.reshape(rows * heads, 1, prefix_len), own_scores], dim=-1
        )  # (rows * heads, 1, prefix + own)
        weights_float = utils.softmax(weights, dim=-1)
        probs = self.dropout_module(weights_float.type_as(weights))

        prefix_probs = probs[..., :prefix_len].reshape(sentences, beams, heads, prefix_len).transpose(1, 2)
        attended = torch.bmm(
            prefix_probs.reshape(sentences * heads, beams, prefix_len),
            prefix_values.view(sentences * heads, prefix_len, head_dim),
        )  # (sentences * heads, beams, head_dim)
        attended = attended.view(sentences, heads, beams, head_dim).transpose(1, 2).reshape(rows * heads, 1, head_dim)
        attended = attended + torch.bmm(probs[..., prefix_len:], own_values.view(rows * heads, own_len, head_dim))
        output = self.out_proj(attended.view(1, rows, embed_dim))
        if not need_weights:
            return output, None
        head_weights = weights_float.view(rows, heads, 1, prefix_len + own_len).transpose(1, 0)  # as stock lays them out
        return output, head_weights if need_head_weights else head_weights.mean(dim=0)

    def _append_own_keys_values(self, query, cached, rows):
        """The beams' own keys and values (rows, heads, own, head_dim) with this step's appended, stored in ``cached``."""
        shape = (rows, self.num_heads, 1, self.head_dim)
        keys = self.k_proj(query).view(shape)
        values = self.v_proj(query).view(shape)
        if "prev_key" in cached:
            keys = torch.cat([cached["prev_key"], keys], dim=2)
            values = torch.cat([cached["prev_value"], values], dim=2)
        cached["prev_key"], cached["prev_value"] = keys, values
        return keys, values

    def start_own_positions(self, incremental_state):
        """End of the shared steps: what the cache holds (one row per sentence) becomes the prefix part;
        the next positions are cached per beam."""
        cached = self._get_input_buffer(incremental_state)
        if "prev_key" not in cached or "prefix_key" in cached:
            return
        cached["prefix_key"] = cached.pop("prev_key")
        cached["prefix_value"] = cached.pop("prev_value")
        cached["prefix_key_padding_mask"] = cached.pop("prev_key_padding_mask", None)
        self._set_input_buffer(incremental_state, cached)

    def reorder_shared(self, incremental_state, new_order, sentence_order):
        """Reorder a sharing generator's cache: per-beam parts by ``new_order`` (B*M rows),
        per-sentence parts (the prefix, or everything during the shared steps) by ``sentence_order``,
        only when sentences left the batch."""
        cached = self._get_input_buffer(incremental_state)
        per_beam = {"prev_key", "prev_value", "prev_key_padding_mask"} if "prefix_key" in cached else set()
        for name, tensor in cached.items():
            if tensor is None:
                continue
            if name in per_beam:
                cached[name] = tensor.index_select(0, new_order)
            elif tensor.size(0) != sentence_order.numel():
                cached[name] = tensor.index_select(0, sentence_order)
        self._set_input_buffer(incremental_state, cached)


def supports_shared_prompt(model) -> bool:
    """Whether ``model`` is a decoder-only transformer language model whose self-attention
    :class:`SharedPromptAttention` can serve.

    ``transformer_lm`` models qualify; decoders with cross-self-attention, layers
    or feature extraction of their own, or attention variants (extra bias
    key/value, zero attention, xformers) do not.  Not detected: a decoder
    subclass whose overridden ``forward`` or ``output_layer`` mixes rows of the
    batch (it would see one row per sentence during the prompt).
    """
    if not isinstance(model, TransformerLanguageModel) or hasattr(model, "encoder"):
        return False
    layers = stock_decoder_layers(model.decoder)
    return layers is not None and all(
        layer.encoder_attn is None and plain_attention(layer.self_attn, SharedPromptAttention) for layer in layers
    )


def self_attention_modules(model) -> List[MultiheadAttention]:
    return [layer.self_attn for layer in model.decoder.layers]


def shared_prompt_length(prefix_tokens: Optional[torch.Tensor], pad: int, eos: int) -> int:
    """P: the forced prompt tokens every sentence of the batch starts with (leading tokens
    that are neither pad, where fairseq stops forcing, nor eos, where it finalizes beams)."""
    if prefix_tokens is None or prefix_tokens.numel() == 0:
        return 0
    forced = prefix_tokens.ne(pad) & prefix_tokens.ne(eos)  # (B, prompt)
    return int(forced.long().cumprod(dim=1).sum(dim=1).min())


class _PromptSharing:
    """A generator's ``_generate`` and EnsembleModel methods, for a prompt cached once per sentence.

    ``_generate`` records the prompt of each call.  Steps 0..P are shared
    (decoder on beam 0 of each sentence, output repeated for its M beams) as
    long as beam 0 of every sentence holds the prompt in the token buffer; at
    the first other step the caches' per-sentence rows become their prefix
    part.  SequenceGenerator reorders with ``new_order`` over the B*M beam rows:
    beam moves within a sentence and, when sentences finish, the rows of the
    remaining ones; per-sentence state follows sentence ``new_order[s*M] // M``.
    """

    def __init__(self, generator: SequenceGenerator, ensemble: EnsembleModel, beams: int,
                 attention_modules: List[List[SharedPromptAttention]]):
        self.beams = beams
        self.pad, self.eos = generator.pad, generator.eos
        self.attention_modules = attention_modules  # per model of the ensemble
        # what unshare_prompt_cache restores
        self.original_classes = [[type(module) for module in modules] for modules in attention_modules]
        self.generate_all = generator._generate
        self.forward_all_decoders = ensemble.forward_decoder
        self.reorder_all_incremental_states = ensemble.reorder_incremental_state
        self.generating = False  # the ensemble is stock outside this generator's _generate
        self.prompt: Optional[torch.Tensor] = None  # (remaining sentences, prompt length) while generating
        self.shared_steps = -1  # steps 0..shared_steps run once per sentence
        self.sharing = False  # still in the shared steps

    def generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        self.prompt = prefix_tokens
        self.shared_steps = shared_prompt_length(prefix_tokens, self.pad, self.eos)
        self.generating = self.sharing = True
        try:
            return self.generate_all(sample, prefix_tokens, constraints, bos_token)
        finally:
            self.prompt = None
            self.generating = self.sharing = False

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        if not self.generating:
            return self.forward_all_decoders(tokens, encoder_outs, incremental_states, temperature)
        if self.sharing and self._beam_zero_holds_prompt(tokens):
            sentence_tokens = tokens[:: self.beams]  # (B, step + 1): beam 0 of each sentence
            probs, attn = self.forward_all_decoders(sentence_tokens, encoder_outs, incremental_states, temperature)
            return probs.repeat_interleave(self.beams, dim=0), _repeat_rows(attn, self.beams)
        if self.sharing:
            self.sharing = False
            for modules, state in zip(self.attention_modules, incremental_states):
                for module in modules:
                    module.start_own_positions(state)
        return self.forward_all_decoders(tokens, encoder_outs, incremental_states, temperature)

    def _beam_zero_holds_prompt(self, tokens) -> bool:
        """Whether this step (decoder input ``tokens``, (B*M, step + 1)) can be shared."""
        step = tokens.size(1) - 1
        if step > self.shared_steps:
            return False
        if step == 0:
            return True
        assert self.prompt is not None
        return bool(tokens[:: self.beams, 1 : step + 1].eq(self.prompt[:, :step]).all())

    def reorder_incremental_state(self, incremental_states: List[IncrementalState], new_order):
        if not self.generating:
            return self.reorder_all_incremental_states(incremental_states, new_order)
        sentence_order = new_order.view(-1, self.beams)[:, 0] // self.beams
        if self.prompt is not None and self.prompt.size(0) != sentence_order.numel():
            self.prompt = self.prompt.index_select(0, sentence_order)
        for modules, state in zip(self.attention_modules, incremental_states):
            for module in modules:
                module.reorder_shared(state, new_order, sentence_order)


def _repeat_rows(tensor: Optional[torch.Tensor], beams: int) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.repeat_interleave(beams, dim=0)


def share_prompt_cache(generator) -> bool:
    """Make a stock SequenceGenerator decode a language model's prompt once per sentence
    and keep its self-attention keys/values so; returns whether it did.

    Nothing changes for beam 1, for generators other than SequenceGenerator
    (and its subclasses), for searches other than beam search and sampling,
    or when any model of the ensemble does not :func:`supports_shared_prompt`.
    The models' self-attention modules become :class:`SharedPromptAttention`
    (same parameters, stock behaviour for every call whose cache has no prefix
    part), so other generators built on the same models are unaffected.
    """
    found = stock_beam_ensemble(generator)
    if found is None:
        return False
    ensemble, beams = found
    if shares_prompt_cache(generator):
        return True
    if type(generator.search) not in SHARED_SEARCHES:
        return False
    if not ensemble.has_incremental_states() or not all(supports_shared_prompt(m) for m in ensemble.models):
        return False
    attention_modules = [self_attention_modules(model) for model in ensemble.models]
    sharing = _PromptSharing(generator, ensemble, beams, attention_modules)
    for modules in attention_modules:
        for module in modules:
            module.__class__ = SharedPromptAttention
    generator._generate = sharing.generate
    ensemble.forward_decoder = sharing.forward_decoder
    ensemble.reorder_incremental_state = sharing.reorder_incremental_state
    return True


def unshare_prompt_cache(generator) -> bool:
    """Undo :func:`share_prompt_cache`: the generator's and the ensemble's methods and the models' attention
    modules as they were; returns whether there was anything to undo."""
    if not shares_prompt_cache(generator):
        return False
    sharing = generator.model.reorder_incremental_state.__self__
    for modules, classes in zip(sharing.attention_modules, sharing.original_classes):
        for module, original in zip(modules, classes):
            module.__class__ = original
    del generator._generate  # the instance attributes that shadowed the classes' methods
    del generator.model.forward_decoder, generator.model.reorder_incremental_state
    return True


def shares_prompt_cache(generator) -> bool:
    """Whether :func:`share_prompt_cache` switched ``generator`` to the shared prompt."""
    reorder = getattr(getattr(generator, "model", None), "reorder_incremental_state", None)
    return isinstance(getattr(reorder, "__self__", None), _PromptSharing)


def prompt_cache_bytes(models, incremental_states: List[IncrementalState]) -> int:
    """Bytes held by the self-attention caches (keys, values, padding masks; prefix and
    per-beam parts) of ``models`` in ``incremental_states`` (one state per model, as
    SequenceGenerator keeps them)."""
    return attention_cache_bytes(self_attention_modules, models, incremental_states)
