"""The engine as runners: the same interface as ``ModelRunner``, another cache underneath.

Decoders ask their runner for ``encode``, ``step``, ``step_block``,
``reorder_cache``, ``concat_caches``, ``widen_cache``, ``keep_accepted``, ``place_rows`` and
never look inside the cache, so they do not know which engine runs their steps:

* :class:`StaticRunner` (``--step-engine static``): the exact form of
  :class:`~fairseq_fastgen.engine.decoder_step.DecoderStep`, eager; bitwise
  fairseq's hypotheses on the CPU.
* ``CompiledRunner`` (``--step-engine compiled``, ``compiled.py``): the padded
  form through ``torch.compile``.
"""

import copy

from torch import Tensor

from fairseq_fastgen.engine.decoder_step import DecoderStep
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.engine.fairseq_runner import ModelRunner


INITIAL_POSITIONS = 32  # target positions a new cache holds before it first grows


class StaticRunner(ModelRunner):
    engine = "static"

    def __init__(self, model, temperature: float = 1.0, projection=None, blocks_by_position: bool = False):
        super().__init__(model, temperature, projection)
        self.decoder_step = DecoderStep(model.decoder, blocks_by_position)

    # ---- cache ------------------------------------------------------------------------------
    @staticmethod
    def new_cache(capacity: int = 0) -> StaticCache:
        """Room for INITIAL_POSITIONS positions, doubled when a row needs more: buffers sized for the
        longest allowed target (200 and more) would mostly hold nothing and spread the rows' keys apart."""
        return StaticCache(max(min(capacity, INITIAL_POSITIONS), 1))

    @staticmethod
    def reorder_cache(cache: StaticCache, index: Tensor):
        if cache.started:
            cache.select(index)

    @staticmethod
    def copied_cache(cache: StaticCache) -> StaticCache:
        return copy.copy(cache)  # reorders replace its buffers, never write into them

    @staticmethod
    def concat_caches(caches):
        if not any(c.started for c in caches):  # cohorts encoded together, before their first step
            return StaticCache(max(c.capacity for c in caches), caches[0].zeroed)
        if not all(c.started for c in caches):
            raise ValueError("a cache that has run no step cannot join one that has")
        return StaticCache.concat(caches)

    @staticmethod
    def widen_cache(cache: StaticCache, src_len: int, extra: int):
        if cache.started:
            cache.widen_source(extra)

    @staticmethod
    def narrow_cache(cache: StaticCache, width: int):
        if cache.started:
            cache.narrow_source(width)

    def start_cache(self, cache: StaticCache, encoder_out):
        """At a cache's first step: the encoder-decoder keys/values of its rows, once (a cache started already,
        rows taken from sources encoded ahead, keeps them)."""
        if cache.started:
            return
        states = encoder_out["encoder_out"][0]  # (src_len, rows, dim)
        masks = encoder_out["encoder_padding_mask"]
        keys, values = self.decoder_step.encoder_keys_values(states)
        step, mask = self.decoder_step, masks[0] if masks else None
        cache.start(keys, values, mask, step.heads, step.head_dim, StaticCache.row_origins(states, mask))

    # ---- one decoder step ------------------------------------------------------------------------
    def step(self, tokens: Tensor, encoder_out, cache: StaticCache):
        """As ``ModelRunner.step``: lprobs (rows, vocab) and attn (rows, src_len) of the next token."""
        features, attn = self.next_position(tokens, encoder_out, cache, self.decoder_step.exact)
        return self.lprobs(features), attn[:, -1, :]

    def next_position(self, tokens: Tensor, encoder_out, cache: StaticCache, form):
        """Features (rows, 1, dim) and attention (rows, 1, src_len) of the position after the prefixes
        ``tokens`` (rows, length), by ``form(last_tokens, position_rows, cache)`` of the decoder step."""
        if not cache.started:
            self.start_cache(cache, encoder_out)
        length = tokens.size(1)  # the row's prefix, bos included
        if cache.length != length - 1:
            raise RuntimeError(f"static cache holds {cache.length} positions, the prefix {length}: a bug")
        cache.ensure_room(length)
        table = self.decoder_step.position_table(length)
        position_row = None
        if table is not None:
            position_row = table[self.model.decoder.padding_idx + length, :].expand(tokens.size(0), 1, -1)
        return form(tokens[:, -1:], position_row, cache)

    def step_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """As ``ModelRunner.step_block`` (fairseq's ``forward_block`` of a k-head decoder)."""
        if not cache.started:
            self.start_cache(cache, encoder_out)
        cache.ensure_room(cache.length + tokens.size(1))
        table = self.decoder_step.position_table(int(positions.max()) + 1)
        position_rows = None
        if table is not None:
            position_rows = table[positions + (self.model.decoder.padding_idx + 1)]  # (rows, n, dim)
        return self.decoder_step.exact(tokens, position_rows, cache, first_head=False)

    @staticmethod
    def keep_accepted(cache: StaticCache, accepted: Tensor):
        cache.keep_accepted(accepted)

    @staticmethod
    def place_rows(cache: StaticCache, slots: Tensor, fresh: StaticCache, rows: Tensor):
        cache.place(slots, fresh, rows)

    @staticmethod
    def release_rows(cache: StaticCache, rows: Tensor):
        cache.release(rows)

    @staticmethod
    def drop_leading_padding(cache: StaticCache):
        cache.drop_leading_padding()

    @staticmethod
    def drop_last_positions(cache: StaticCache, dropped: int):
        cache.drop_last(dropped)
