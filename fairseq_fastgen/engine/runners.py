"""The engine as runners: the same interface as ``ModelRunner``, another cache underneath.

Decoders ask their runner for ``encode``, ``step``, ``step_block``, ``keep_accepted``, hand it
their rows' layout plans (``carry_out``: rows kept, placed or released, sources widened or narrowed,
carried out by ``reorder_cache``, ``place_rows``, ``widen_cache``, ...) and never look inside the cache,
so they do not know which engine runs their steps:

* :class:`StaticRunner` (``--step-engine static``): the exact form of
  :class:`~fairseq_fastgen.engine.decoder_step.DecoderStep`, eager; bitwise
  fairseq's hypotheses on the CPU.
* ``CompiledRunner`` (``--step-engine compiled``, ``compiled.py``): the padded
  form through ``torch.compile``.
"""

import torch
from torch import Tensor

from fairseq_fastgen.engine.decoder_step import DecoderStep
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.engine.fairseq_runner import ModelRunner


INITIAL_POSITIONS = 32  # target positions a new cache holds before it first grows
# target positions a beam search's cache keeps beyond its written ones at each reorder (and gets, where it has
# none left): it reorders at every step, so its cache holds about what it wrote, as fairseq's does
REORDERED_ROOM = 1


def shared_by_beams(origin: Tensor, beams: int) -> bool:
    """Whether rows whose encoder states have ``origin`` (rows,; ``StaticCache.row_origins``) are sentences
    of ``beams`` equal rows each, as fairseq's beam search lays them out."""
    rows = origin.numel()
    if rows % beams:
        return False
    return torch.equal(origin, torch.arange(0, rows, beams, device=origin.device).repeat_interleave(beams))


class StaticRunner(ModelRunner):
    engine = "static"
    # rows a stream keeps a multiple of once its finished rows may go (JoinedGreedyPolicy.drain): MKL's products
    # cost no more at the next multiple of 4 rows than below it, and less than at the counts between
    kept_row_multiple = 4

    def __init__(self, model, temperature: float = 1.0, projection=None, blocks_by_position: bool = False,
                 beams: int = 1):
        super().__init__(model, temperature, projection)
        self.decoder_step = DecoderStep(model.decoder, blocks_by_position)
        # fairseq's beam search keeps each sentence's ``beams`` rows together: their caches then hold the
        # encoder-decoder keys/values once per sentence (StaticCache.beams)
        self.beams = beams

    # ---- cache ------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 0) -> StaticCache:
        """Room for INITIAL_POSITIONS positions, doubled when a row needs more: buffers sized for the longest
        allowed target (200 and more) would mostly hold nothing and spread the rows' keys apart.  fairseq's
        beam search (``beams`` > 1) reorders at every step, each reorder leaving REORDERED_ROOM positions."""
        return StaticCache(max(min(capacity, REORDERED_ROOM if self.beams > 1 else INITIAL_POSITIONS), 1))

    def reorder_cache(self, cache: StaticCache, index: Tensor):
        if cache.started:  # other decoders reorder when rows leave: their caches keep their room
            cache.select(index, REORDERED_ROOM if self.beams > 1 else None)

    @staticmethod
    def copied_cache(cache: StaticCache) -> StaticCache:
        return cache.copy()

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
        step, mask = self.decoder_step, masks[0] if masks else None
        origin = StaticCache.row_origins(states, mask)
        if self.beams > 1 and shared_by_beams(origin, self.beams):
            first_beams = origin[:: self.beams]  # each sentence's first beam: its keys serve all its beams
            keys, values = step.encoder_keys_values(states, first_beams)
            mask = None if mask is None else mask.index_select(0, first_beams)
            cache.start(keys, values, mask, step.heads, step.head_dim, origin, self.beams)
            return
        keys, values = step.encoder_keys_values(states)
        cache.start(keys, values, mask, step.heads, step.head_dim, origin)

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
