"""The model runner: how one decoding step of a fairseq encoder-decoder runs.

Decoders decide *what* comes next; the runner decides *how* the model is run:
encoding, one incremental decoder step, the vocabulary projection (full, or
restricted to a cluster-projected set of columns), and the bookkeeping of the
encoder output and the incremental cache when rows are reordered or merged.
"""

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq import utils

from fairseq_fastgen.engine.fused_weights import plain_output_projection
from fairseq_fastgen.engine.int8_proposals import Int8Proposer
from fairseq_fastgen.engine.row_plans import (KeepRows, LeftJustifySources, NarrowSources, PlaceRows, ReleaseRows,
                                              WidenSources)
from fairseq_fastgen.engine.runner_types import PlacesRows
from fairseq_fastgen.fastseq.shared_cache import (encoder_attention_modules, encoder_keys_shared_by_beams,
                                                  supports_shared_cache)
from fairseq_fastgen.ops.aligned_rows import aligned_rows_linear
from fairseq_fastgen.ops.linear_forward import has_stand_in


def encoder_output(states: Tensor, padding: Tensor, **fields) -> Dict[str, List[Tensor]]:
    """fairseq's encoder-output dict of ``states`` (src_len, rows, dim) and ``padding`` (rows, src_len) bool, the
    other fields empty unless given (``src_lengths=[lengths]``)."""
    output = {"encoder_out": [states], "encoder_padding_mask": [padding], "encoder_embedding": [],
              "encoder_states": [], "src_tokens": [], "src_lengths": []}
    output.update(fields)
    return output


def sources_of(encoder_out):
    """(states (src_len, rows, dim), padding (rows, src_len) bool) of fairseq's encoder-output dict."""
    return encoder_out["encoder_out"][0], encoder_out["encoder_padding_mask"][0]


def vocabulary_logits(decoder, features: Tensor) -> Tensor:
    """``decoder.output_layer(features)``: (rows, n, dim) -> (rows, n, vocab); a plain projection with no stand-in
    product attached (``--onednn-linear``, ``--quantize``) writes its logits in aligned rows, the same bits
    (``ops/aligned_rows.py``)."""
    projection = plain_output_projection(decoder)
    if projection is None or has_stand_in(projection):
        return decoder.output_layer(features)
    return aligned_rows_linear(features, projection.weight)


class SentenceKeysCache(dict):
    """fairseq's incremental state (the dict its decoder reads and writes) of a beam search whose ``beams`` beams
    per sentence attend to their sentence's encoder-decoder keys/values, held once."""

    def __init__(self, beams: int):
        super().__init__()
        self.beams = beams


class ModelRunner:
    """``--step-engine fairseq``: a :class:`~fairseq_fastgen.engine.runner_types.Runner` over fairseq's own
    incremental decoder and its dict cache (grown with ``torch.cat``); the base of the step engines' runners.

    Built for fairseq's beam search (``beams`` > 1) over a model whose encoder-decoder attention allows it
    (``fastseq.shared_cache.supports_shared_cache``), the beams of a sentence attend to its keys/values held
    once in the cache (FastSeq's shared attention, switched on for this runner's calls only), bitwise stock
    fairseq's step; otherwise every beam keeps its copy."""

    def __init__(self, model, temperature: float = 1.0, projection=None, beams: int = 1):
        self.model = model
        self.temperature = temperature
        sharing = beams > 1 and supports_shared_cache(model)
        self.shared_attention = encoder_attention_modules(model) if sharing else []
        self.beams = beams if sharing else 1  # rows of a sentence sharing its encoder-decoder keys in the cache
        # projection(features (rows, n, dim), decoder) -> logits (rows, n, vocab); None: full projection
        self.projection = projection
        # what a decoder may ask of the model, which it never holds: the target positions it has, and whether
        # a k-head model's head 1 is its base output (blockwise then scores a block with the pass)
        self.max_target_positions = int(model.decoder.max_positions())
        self.identity_first_head = bool(getattr(getattr(model.decoder, "heads", None), "identity_first", False))
        self.proposer = None  # Int8Proposer, made on the first int8_proposals()

    # ---- encoder ------------------------------------------------------------
    def encode(self, net_input) -> Dict[str, List[Tensor]]:
        return self.model.encoder.forward_torchscript(net_input)

    def reorder_encoder_out(self, encoder_out, index: Tensor):
        return self.model.encoder.reorder_encoder_out(encoder_out, index)

    def concat_encoder_out(self, encoder_outs):
        """Concatenate encoder outputs of several cohorts along the batch dimension.

        Sources of different padded lengths are left-padded to the longest
        (fairseq's translation task pads sources on the left) and the padding
        mask marks the added positions.
        """
        src_len = max(e["encoder_out"][0].size(0) for e in encoder_outs)
        outs, masks = [], []
        for e in encoder_outs:
            x = e["encoder_out"][0]  # (src_len_i, rows_i, dim)
            rows, extra = x.size(1), src_len - x.size(0)
            mask = e["encoder_padding_mask"][0] if e["encoder_padding_mask"] else x.new_zeros((rows, x.size(0)), dtype=torch.bool)
            outs.append(torch.nn.functional.pad(x, (0, 0, 0, 0, extra, 0)))
            masks.append(torch.nn.functional.pad(mask, (extra, 0), value=True))
        return encoder_output(torch.cat(outs, dim=1), torch.cat(masks, dim=0))

    # ---- the sources' layout: what a streaming scheduler plans, carried out on the encoder output -----------
    @staticmethod
    def source_padding(encoder_out) -> Tensor:
        """(rows, src_len) bool: the padding positions of each row's source."""
        return encoder_out["encoder_padding_mask"][0]

    @staticmethod
    def right_padded_sources(encoder_out, rows: int, length: int, width: int):
        """The first ``rows`` rows of an encoder output of sources all ``length`` long, right-padded to ``width``
        positions (a streaming refill's sources laid out so that no sentence's numbers depend on its companions)."""
        states = encoder_out["encoder_out"][0][:, :rows]  # (length, rows, dim)
        padding = states.new_ones((rows, width), dtype=torch.bool)  # (rows, width)
        padding[:, :length] = False
        return encoder_output(F.pad(states, (0, 0, 0, 0, 0, width - length)), padding)  # (width, rows, dim)

    @staticmethod
    def widened_sources(encoder_out, extra: int):
        """``encoder_out`` with ``extra`` padding positions after every row's source."""
        states, padding = sources_of(encoder_out)
        return dict(encoder_out, encoder_out=[F.pad(states, (0, 0, 0, 0, 0, extra))],  # (src_len + extra, rows, dim)
                    encoder_padding_mask=[F.pad(padding, (0, extra), value=True)])  # (rows, src_len + extra)

    @staticmethod
    def left_justified_sources(encoder_out):
        """``encoder_out`` with each row's source positions first and its padding after them (fairseq left-pads
        sources): the layout in which a stream's source width shrinks when its longest sources finish."""
        states, mask = sources_of(encoder_out)  # (src, rows, dim), (rows, src)
        leading = mask.long().cumprod(dim=1).sum(dim=1)  # (rows,) padding positions before each row's source
        if not bool(leading.any()):
            return encoder_out
        src_len = mask.size(1)
        positions = torch.arange(src_len, device=mask.device)
        index = (positions.unsqueeze(0) + leading.unsqueeze(1)) % src_len  # (rows, src): rotated left
        states = states.gather(0, index.t().unsqueeze(2).expand(-1, -1, states.size(2)))
        return dict(encoder_out, **encoder_output(states, mask.gather(1, index)))

    @staticmethod
    def narrowed_sources(encoder_out, width: int):
        """``encoder_out`` cut to its first ``width`` source positions."""
        states, padding = sources_of(encoder_out)
        return dict(encoder_out, encoder_out=[states[:width]], encoder_padding_mask=[padding[:, :width]])

    @staticmethod
    def placed_sources(encoder_out, slots: Tensor, fresh_encoder_out, rows: Tensor):
        """``encoder_out`` whose rows ``slots`` (n,) hold the rows ``rows`` (n,) of ``fresh_encoder_out``, of the
        same width (a refill's rows taking finished rows' places); the running rows are not copied elsewhere."""
        states, mask = (tensor.clone() for tensor in sources_of(encoder_out))
        fresh_states, fresh_mask = sources_of(fresh_encoder_out)
        states[:, slots] = fresh_states.index_select(1, rows)  # (src_len, n, dim)
        mask[slots] = fresh_mask.index_select(0, rows)  # (n, src_len)
        return dict(encoder_out, encoder_out=[states], encoder_padding_mask=[mask])

    # ---- incremental cache -----------------------------------------------------
    @staticmethod
    def surviving_rows(finished: Tensor) -> Tensor:
        """The rows a state keeps when rows ``finished`` (rows,) bool leave, in the order this engine keeps
        them: here their own (rows - finished,)."""
        return (~finished).nonzero().squeeze(1)

    def new_cache(self, capacity: int = 0) -> Dict[str, Dict[str, Optional[Tensor]]]:
        """An empty cache; ``capacity`` (the longest target, with bos) lets a static engine preallocate."""
        if self.beams > 1:
            return SentenceKeysCache(self.beams)
        return torch.jit.annotate(Dict[str, Dict[str, Optional[Tensor]]], {})

    def reorder_cache(self, cache, index: Tensor):
        """Move every cached tensor (self- and encoder-decoder attention) to ``index``.

        Not fairseq's ``reorder_incremental_state``: it leaves the encoder-decoder
        keys/values in place whenever the row count is unchanged (stock beam
        search only reorders beams within a sentence), which mixes up sentences
        when a policy reorders rows across sentences at a constant count.  A beam
        search's cache of keys held per sentence is reordered by fairseq's rule
        (beams move within their sentence; finished sentences leave).
        """
        if isinstance(cache, SentenceKeysCache):
            with encoder_keys_shared_by_beams(self.shared_attention, cache.beams):
                self.model.decoder.reorder_incremental_state_scripting(cache, index)
            return
        for buffers in cache.values():
            for name, value in buffers.items():
                if value is not None:
                    buffers[name] = value.index_select(0, index)

    @staticmethod
    def copied_cache(cache):
        """A cache holding the same tensors as ``cache``, which ``reorder_cache`` can reorder without touching
        ``cache`` (streaming takes a refill's rows from a group of sources started ahead)."""
        return {key: dict(buffers) for key, buffers in cache.items()}

    @staticmethod
    def concat_caches(caches):
        """Concatenate the incremental caches of several cohorts.

        Cached keys/values of different widths (encoder-decoder ones of different source lengths;
        self-attention ones of cohorts at different target lengths, which only blockwise decoding's
        k-head decoder reads with their padding) are left-padded, and their key padding masks extended
        accordingly.
        """
        merged = {}
        for key in caches[0]:
            buffers = [c[key] for c in caches]
            merged[key] = {name: None for name in buffers[0]}
            keys = [b.get("prev_key") for b in buffers]
            if keys[0] is None:
                continue
            width = max(k.size(2) for k in keys)  # (rows, heads, width, head_dim)
            for name in ("prev_key", "prev_value"):
                merged[key][name] = torch.cat([F.pad(b[name], (0, 0, width - b[name].size(2), 0)) for b in buffers])
            masks = [b.get("prev_key_padding_mask") for b in buffers]
            if all(m is None for m in masks) and all(k.size(2) == width for k in keys):
                continue
            masks = [k.new_zeros((k.size(0), k.size(2)), dtype=torch.bool) if m is None else m.bool()
                     for m, k in zip(masks, keys)]
            merged[key]["prev_key_padding_mask"] = torch.cat([F.pad(m, (width - m.size(1), 0), value=True)
                                                              for m in masks])
        return merged

    @staticmethod
    def widen_cache(cache, src_len: int, extra: int):
        """Right-pad the cached encoder-decoder keys/values (and their padding mask) of a cache
        whose source is ``src_len`` wide by ``extra`` masked positions (streaming merges)."""
        for buffers in cache.values():
            key_padding = buffers.get("prev_key_padding_mask")
            if key_padding is None or key_padding.size(1) != src_len:
                continue  # decoder self-attention: no source positions
            buffers["prev_key"] = F.pad(buffers["prev_key"], (0, 0, 0, extra))  # (rows, heads, width, head_dim)
            buffers["prev_value"] = F.pad(buffers["prev_value"], (0, 0, 0, extra))
            buffers["prev_key_padding_mask"] = F.pad(key_padding, (0, extra), value=True)

    # ---- a scheduler's plans (``row_plans``), carried out by the operations above ----------------------
    def carry_out(self, plan, encoder_out, cache):
        """Carry out ``plan`` (a ``row_plans`` plan) on ``encoder_out``, returned anew, and ``cache``, changed in
        place, by this runner's own operations (which the step engines override).  A plan this runner cannot
        carry out (rows placed or released, sources narrowed: only a :class:`PlacesRows` cache can) is refused
        (``ValueError``)."""
        if isinstance(plan, KeepRows):
            encoder_out = self.reorder_encoder_out(encoder_out, plan.index)
            self.reorder_cache(cache, plan.index)
            return encoder_out
        if isinstance(plan, WidenSources):
            encoder_out = self.widened_sources(encoder_out, plan.extra)
            self.widen_cache(cache, plan.src_len, plan.extra)
            return encoder_out
        if isinstance(plan, LeftJustifySources):  # the cache holds no encoder-decoder keys yet
            return self.left_justified_sources(encoder_out)
        if not isinstance(plan, (PlaceRows, ReleaseRows, NarrowSources)):
            raise ValueError(f"{type(plan).__name__} is not a plan of engine/row_plans.py")
        if not isinstance(self, PlacesRows):
            raise ValueError(f"{type(self).__name__} cannot carry out {type(plan).__name__}: its cache takes no "
                             f"rows in place (only the step engines' do: --step-engine static or compiled)")
        if isinstance(plan, PlaceRows):
            encoder_out = self.placed_sources(encoder_out, plan.slots, plan.fresh_encoder_out, plan.rows)
            self.place_rows(cache, plan.slots, plan.fresh_cache, plan.rows)
        elif isinstance(plan, ReleaseRows):
            if plan.rows is not None:
                self.release_rows(cache, plan.rows)
            self.drop_leading_padding(cache)  # the positions only the released rows attended
        else:
            encoder_out = self.narrowed_sources(encoder_out, plan.width)
            self.narrow_cache(cache, plan.width)
        return encoder_out

    def merged_rows(self, encoder_outs, caches):
        """(encoder output, cache) of the rows of several groups, one group after the other (new objects;
        sources left-padded to the widest, as ``concat_encoder_out`` and ``concat_caches`` pad them)."""
        return self.concat_encoder_out(encoder_outs), self.concat_caches(caches)

    # ---- one decoder step ------------------------------------------------------
    def step(self, tokens: Tensor, encoder_out, cache):
        """Log-probabilities of the next token of every row.

        tokens: (rows, length) the full prefix of every row (the decoder reads only
        the last position, earlier ones come from ``cache``).
        Returns lprobs (rows, vocab) float and attn (rows, src_len) or None.
        """
        if isinstance(cache, SentenceKeysCache):
            with encoder_keys_shared_by_beams(self.shared_attention, cache.beams):
                if not cache:  # the first step: a sentence's beams are adjacent copies of its encoder rows
                    first_beams = torch.arange(0, tokens.size(0), cache.beams, device=tokens.device)
                    encoder_out = self.reorder_encoder_out(encoder_out, first_beams)
                return self.extracted_step(tokens, encoder_out, cache)
        return self.extracted_step(tokens, encoder_out, cache)

    def extracted_step(self, tokens: Tensor, encoder_out, cache):
        """``step`` by fairseq's ``extract_features`` and the runner's projection."""
        decoder = self.model.decoder
        features, extra = decoder.extract_features(tokens, encoder_out=encoder_out, incremental_state=cache)
        attn = extra.get("attn", [None])[0] if isinstance(extra, dict) else None
        if attn is not None:
            attn = attn[:, -1, :]  # (rows, src_len)
        return self.lprobs(features[:, -1:, :]), attn

    def step_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache):
        """Several new positions per row (blockwise verification): tokens and their target positions
        (rows, n), each row against its cached positions, causal among the new ones.  Returns the base
        decoder output (rows, n, dim) (a k-head decoder's heads not applied) and the encoder attention
        (rows, n, src_len) or None; the new positions stay cached until ``keep_accepted`` or
        ``drop_last_positions`` drops some."""
        return self.model.decoder.forward_block(tokens, positions, encoder_out, cache)

    def step_block_scored(self, tokens: Tensor, positions: Tensor, encoder_out, cache):
        """``step_block`` and the log-probabilities (rows, n, vocab) of its base output (``project``): head 1's
        of a k-head decoder whose head 1 is the base output (``--khead-identity-first``)."""
        features, attn = self.step_block(tokens, positions, encoder_out, cache)
        return features, attn, self.project(features.contiguous())

    def step_rows(self, last_tokens: Tensor, positions: Tensor, encoder_out, cache):
        """One new position per row, each row at its own target position (rows joined at different lengths):
        last_tokens (rows, 1), positions (rows,).  Returns lprobs (rows, vocab) and attn (rows, src_len) or
        None, as ``step``."""
        features, attn = self.step_block(last_tokens, positions.unsqueeze(1), encoder_out, cache)
        return self.project(features.contiguous())[:, 0], (None if attn is None else attn[:, 0])

    def heads(self, features: Tensor, block_size: int) -> Tensor:
        """The first ``block_size`` heads (..., block, dim) of a k-head decoder's outputs (..., dim)."""
        return self.model.decoder.heads(features)[..., :block_size, :]

    def int8_proposals(self, tokens: Optional[Tensor] = None) -> Int8Proposer:
        """int8 copies of the weights that make blockwise's proposals of heads 2..k
        (``--blockwise-int8-proposals``; ``tokens`` (N,): the only tokens proposed, ``--blockwise-proposal-vocab``),
        made again where the model's weights changed since the last copy (an optimizer step between validations);
        a model they cannot be made for is refused (``ValueError``)."""
        layers = self.proposal_layers()
        if self.proposer is None or not self.proposer.serves(self.model.decoder, layers, tokens):
            self.proposer = Int8Proposer(self.model.decoder, layers, tokens)
        return self.proposer

    def proposal_layers(self):
        """The int8 layers the proposer may read instead of copies of its own (None: none)."""
        return None

    def int8_later_heads(self, features: Tensor, proposer: Int8Proposer) -> Tensor:
        """Heads 2..k (rows, k - 1, dim) of decoder outputs (rows, dim) through the int8 copies of an
        ``Int8Proposer`` (an identity-first k-head layer)."""
        return self.model.decoder.heads.learned(features, proposer.fc1, proposer.fc2)

    def keep_accepted(self, cache, accepted: Tensor):
        """Of the n positions the last ``step_block`` cached, keep those where ``accepted`` (rows, n; a
        prefix of each row) holds."""
        self.model.decoder.rollback(cache, accepted)

    def drop_last_positions(self, cache, dropped: int):
        """Drop the last ``dropped`` cached positions of every row."""
        self.model.decoder.drop_last_positions(cache, dropped)

    def lprobs(self, features: Tensor) -> Tensor:
        """features (rows, 1, dim) -> log-probabilities (rows, vocab) of the next token."""
        return self.project(features)[:, -1, :]

    def project(self, features: Tensor, project=None, normalize: bool = True) -> Tensor:
        """features (rows, n, dim) -> log-probabilities (rows, n, vocab): the projection (full, or the
        cluster projection's; ``project``: features -> logits in its place), the temperature, log-softmax
        (``normalize=False``: the scaled logits as float, for callers that read only their argmax)."""
        decoder = self.model.decoder
        if project is not None:
            logits = project(features)
        elif self.projection is None:
            logits = vocabulary_logits(decoder, features)
        else:
            logits = self.projection(features, decoder)
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        return utils.log_softmax(logits, dim=-1) if normalize else logits.float()
