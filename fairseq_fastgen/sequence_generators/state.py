"""One object that holds every per-row tensor of a decoding pass.

A *row* is one hypothesis under construction (one per sentence for greedy and
blockwise decoding, up to ``beam`` per sentence for beam searches).  All
per-row fields move together through :meth:`DecodingState.select`, grow
together through :meth:`DecodingState.append` and merge through
:meth:`DecodingState.concat`, so no decoder keeps parallel tensors in sync by
hand.

Rows hold the same number of tokens (greedy, the beam searches: ``length``),
or, once :meth:`DecodingState.use_row_lengths` gave the state per-row lengths
(blockwise decoding, where rows accept different numbers of tokens), each row
its own (``lengths``): row r's tokens then sit in columns ``1 .. lengths[r]``
of ``tokens`` and columns past them hold padding.
"""

import copy
from typing import Dict, FrozenSet, List, Optional

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_fastgen.engine.row_plans import KeepRows, PlaceRows


class DecodingState:
    def __init__(self, runner, tokens, sentence, max_len, encoder_out, cache, src_len):
        self.runner = runner  # a Runner: carries out the rows' plans on the encoder output and cache
        self.tokens = tokens  # (rows, 1 + width) long, column 0 is the bos (= eos) symbol
        self.cum_scores = tokens.new_zeros((tokens.size(0), 0), dtype=torch.float)  # (rows, width)
        self.attn: Optional[Tensor] = None  # (rows, src_len, width) or None
        self.sentence = sentence  # (rows,) long: index of the row's sentence in the pool
        self.max_len = max_len  # (rows,) long: at step >= max_len only eos may be generated
        self.encoder_out = encoder_out  # fairseq encoder output, batch dimension = rows
        self.cache = cache  # fairseq incremental_state dict, batch dimension = rows
        self.src_len = src_len  # padded source length of every row's encoder output
        # (rows,) long: tokens each row holds, where rows differ (blockwise); None: every row holds ``width``
        self.row_lengths: Optional[Tensor] = None
        self.pad: Optional[int] = None  # the symbol in the columns past a row's length (with row_lengths)
        # a policy's own per-row tensors (rows, ...), moved with the rows (blockwise: the proposed next block)
        self.extra: Dict[str, Optional[Tensor]] = {}
        # the names in ``extra`` whose last dimension is the source's (rows, ..., src_len): resized with it
        self.source_extras: FrozenSet[str] = frozenset()

    @property
    def rows(self) -> int:
        return self.tokens.size(0)

    @property
    def length(self) -> int:
        """Tokens generated so far by every row (not counting the leading bos)."""
        if self.row_lengths is not None:
            raise ValueError("the rows hold different numbers of tokens: read lengths")
        return self.tokens.size(1) - 1

    @property
    def lengths(self) -> Tensor:
        """Tokens generated so far by each row; (rows,) long."""
        if self.row_lengths is not None:
            return self.row_lengths
        return self.tokens.new_full((self.rows,), self.tokens.size(1) - 1)

    def row_length(self, row: int) -> int:
        return self.length if self.row_lengths is None else int(self.row_lengths[row])

    @property
    def scores(self) -> Tensor:
        """Cumulative log-probability of every row; (rows,)."""
        if self.row_lengths is not None:  # the score after each row's last token, 0 before its first
            last = self.cum_scores.gather(1, (self.row_lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            return last.masked_fill(self.row_lengths.le(0), 0.0)
        if self.cum_scores.size(1) == 0:
            return self.cum_scores.new_zeros(self.rows)
        return self.cum_scores[:, -1]

    # ---- growing ----------------------------------------------------------------------
    def append(self, new_tokens, new_lprobs, new_attn=None, accepted=None):
        """Extend every row by ``n`` tokens, or with per-row lengths by those of its ``accepted`` ones.

        new_tokens: (rows, n) long; new_lprobs: (rows, n) float, the log-probability
        of each new token; new_attn: (rows, src_len, n) or None; accepted: (rows, n)
        bool, a prefix of each row (only with per-row lengths; None: every token).
        The cumulative score takes one float addition per token, as stock's steps.
        """
        if new_lprobs.size(1) == 1:
            cumulative = self.scores.unsqueeze(1) + new_lprobs  # (rows, 1)
        else:
            running, cumulative = self.scores, []
            for offset in range(new_lprobs.size(1)):
                running = running + new_lprobs[:, offset]
                cumulative.append(running)
            cumulative = torch.stack(cumulative, dim=1)  # (rows, n)
        if self.row_lengths is not None:
            self._write_accepted(new_tokens, cumulative, new_attn, accepted)
            return
        if accepted is not None:
            raise ValueError("only a state with per-row lengths accepts a part of each row's tokens")
        self.tokens = torch.cat([self.tokens, new_tokens], dim=1)
        self.cum_scores = torch.cat([self.cum_scores, cumulative], dim=1)
        if new_attn is not None:
            self.attn = new_attn if self.attn is None else torch.cat([self.attn, new_attn], dim=2)

    def _write_accepted(self, new_tokens, cumulative, new_attn, accepted):
        """``append`` with per-row lengths: the accepted tokens go to the columns after each row's last."""
        if accepted is None:
            accepted = torch.ones_like(new_tokens, dtype=torch.bool)
        rows, offsets = accepted.nonzero(as_tuple=True)  # (accepted tokens,) each
        columns = self.row_lengths[rows] + offsets
        self.tokens[rows, 1 + columns] = new_tokens[rows, offsets]
        self.cum_scores[rows, columns] = cumulative[rows, offsets]
        if new_attn is not None:
            self._attention_buffer(new_attn, new_attn.size(1))[rows, :, columns] = new_attn[rows, :, offsets]
        self.row_lengths = self.row_lengths + accepted.sum(dim=1)

    def append_each_row(self, new_tokens, new_lprobs, new_attn, taking):
        """``append`` with per-row lengths where the rows ``taking`` (rows,) bool take their one new token
        (``new_tokens``, ``new_lprobs`` (rows, 1), ``new_attn`` (rows, src_len, 1) or None) and the others
        keep their length (the new token goes, unread, to a column past it).  The same float additions."""
        columns = self.row_lengths.clamp(max=self.cum_scores.size(1) - 1).unsqueeze(1)  # (rows, 1)
        cumulative = self.scores.unsqueeze(1) + new_lprobs  # (rows, 1)
        self.tokens.scatter_(1, columns + 1, new_tokens)
        self.cum_scores.scatter_(1, columns, cumulative)
        if new_attn is not None:
            attn = self._attention_buffer(new_attn, new_attn.size(1))  # (rows, src_len, width)
            attn.scatter_(2, columns.unsqueeze(1).expand(-1, attn.size(1), 1), new_attn)
        self.row_lengths = self.row_lengths + taking

    def append_lone_row(self, length: int, new_tokens, new_lprobs, new_attn=None):
        """``append`` for a state of one row that holds ``length`` tokens, with per-row lengths, the scores
        in Python: ``new_tokens`` (count,), their lprobs ``new_lprobs`` (floats of float32 values), their
        attention ``new_attn`` (count, src_len) or None.  The same float32 additions as ``append``."""
        count = new_tokens.size(0)
        cumulative = [numpy.float32(self.cum_scores[0, length - 1].item() if length > 0 else 0.0)]
        for lprob in new_lprobs:  # numpy's float32 addition is IEEE's, as torch's
            cumulative.append(cumulative[-1] + numpy.float32(lprob))
        self.tokens[0, 1 + length: 1 + length + count] = new_tokens
        self.cum_scores[0, length: length + count] = torch.tensor(cumulative[1:], dtype=self.cum_scores.dtype)
        if new_attn is not None:
            self._attention_buffer(new_attn, new_attn.size(1))[0, :, length: length + count] = new_attn.t()
        self.row_lengths = self.row_lengths + count

    def _attention_buffer(self, like, src_len) -> Tensor:
        """``attn`` (rows, src_len, width) of a state with per-row lengths, made at its first attention."""
        if self.attn is None:
            self.attn = like.new_zeros((self.rows, src_len, self.cum_scores.size(1)))
        return self.attn

    def use_row_lengths(self, capacity: int, pad: int) -> "DecodingState":
        """Give every row a length of its own and room for ``capacity`` tokens (columns past a row's
        tokens hold ``pad``, zero scores and attention): rows may then accept different numbers of tokens."""
        extra = capacity - self.cum_scores.size(1)
        self.row_lengths = self.lengths
        self.tokens = F.pad(self.tokens, (0, extra), value=pad)  # (rows, 1 + capacity)
        self.cum_scores = F.pad(self.cum_scores, (0, extra))  # (rows, capacity)
        if self.attn is not None:
            self.attn = F.pad(self.attn, (0, extra))  # (rows, src_len, capacity)
        self.pad = pad
        return self

    def replace_tokens(self, tokens, cum_scores, attn=None):
        """Set token history directly (beam searches rebuild rows from candidates)."""
        self.tokens, self.cum_scores = tokens, cum_scores
        if attn is not None:
            self.attn = attn

    # ---- moving rows --------------------------------------------------------------------
    def select(self, index: Tensor):
        """Keep (and reorder to) the rows in ``index`` (long, may repeat rows)."""
        self.tokens = self.tokens.index_select(0, index)
        self.cum_scores = self.cum_scores.index_select(0, index)
        if self.attn is not None:
            self.attn = self.attn.index_select(0, index)
        self.sentence = self.sentence.index_select(0, index)
        self.max_len = self.max_len.index_select(0, index)
        if self.row_lengths is not None:
            self.row_lengths = self.row_lengths.index_select(0, index)
        for name, value in self.extra.items():
            if value is not None:
                self.extra[name] = value.index_select(0, index)
        self.encoder_out = self.runner.carry_out(KeepRows(index), self.encoder_out, self.cache)

    def resize_source_extras(self, width: int):
        """The source-shaped extras (``source_extras``) cut or right-padded to ``width`` source positions (a
        stream's width follows its longest running source)."""
        for name in self.source_extras:
            value = self.extra.get(name)
            if value is not None and value.size(-1) != width:
                self.extra[name] = _pad_last(value, width) if width > value.size(-1) else value[..., :width]

    def taken(self, index: Tensor) -> "DecodingState":
        """A new state of the rows ``index``, this one unchanged (streaming takes a refill's rows from sources
        encoded and started ahead)."""
        rows = copy.copy(self)
        rows.extra, rows.cache = dict(self.extra), self.runner.copied_cache(self.cache)
        rows.select(index)
        return rows

    def place(self, slots: Tensor, fresh: "DecodingState", rows: Tensor):
        """Rows ``slots`` (n,) of this state (finished ones) take the rows ``rows`` (n,) of ``fresh``, a state of
        rows just started (their bos cached, greedy's first token taken), with per-row lengths as this one and the
        same source width.  Streaming: a refill's rows enter the rows finished ones left straight from the group
        of sources encoded ahead, copying neither the running rows nor the group's; the runner moves the encoder
        output's and the cache's rows (``PlaceRows``)."""
        if self.row_lengths is None or fresh.row_lengths is None or fresh.src_len != self.src_len:
            raise ValueError("rows take others' places only with per-row lengths and equal source widths (a bug)")
        take = lambda tensor: tensor.index_select(0, rows)  # noqa: E731 (n, ...) fresh's rows
        width = max(self.cum_scores.size(1), fresh.cum_scores.size(1))  # token columns
        self.tokens = _pad_last(self.tokens, 1 + width, self.pad)
        self.cum_scores = _pad_last(self.cum_scores, width)
        self.tokens[slots] = _pad_last(take(fresh.tokens), 1 + width, self.pad)
        self.cum_scores[slots] = _pad_last(take(fresh.cum_scores), width)
        if self.attn is None and fresh.attn is not None:
            self._attention_buffer(fresh.attn, self.src_len)
        if self.attn is not None:  # (rows, src_len, width)
            self.attn = _pad_last(self.attn, width)
            self.attn[slots] = 0 if fresh.attn is None else _pad_last(take(fresh.attn), width)
        for name in ("sentence", "max_len", "row_lengths"):
            setattr(self, name, getattr(self, name).clone())  # (rows,) never shared with another state
            getattr(self, name)[slots] = take(getattr(fresh, name))
        self.source_extras |= fresh.source_extras
        for name in {name for name in self.extra} | set(fresh.extra):
            mine, theirs = self.extra.get(name), fresh.extra.get(name)
            theirs = None if theirs is None else take(theirs)
            if mine is None and theirs is not None:
                mine = theirs.new_zeros((self.rows,) + theirs.shape[1:])
            if mine is not None:
                mine = mine.clone()
                mine[slots] = 0 if theirs is None else theirs
            self.extra[name] = mine
        plan = PlaceRows(slots, fresh.encoder_out, fresh.cache, rows)
        self.encoder_out = self.runner.carry_out(plan, self.encoder_out, self.cache)

    def candidate_rows(self, index: Tensor, tokens: Tensor, cum_scores: Tensor, attn=None) -> "DecodingState":
        """The rows ``index`` (k,), each continued by one of ``tokens`` (k,) at the cumulative scores
        ``cum_scores`` (k,) with the attention ``attn`` (k, src_len) or None, as a state of their own
        without encoder output or cache (a beam step's candidates ending in eos, for their hypotheses)."""
        rows = DecodingState(self.runner, torch.cat([self.tokens[index], tokens.unsqueeze(1)], dim=1),
                             self.sentence[index], self.max_len[index], None, None, self.src_len)
        rows.cum_scores = torch.cat([self.cum_scores[index], cum_scores.unsqueeze(1)], dim=1)  # (k, length + 1)
        if attn is not None:
            attn = attn.unsqueeze(2)  # (k, src_len, 1)
            rows.attn = attn if self.attn is None else torch.cat([self.attn[index], attn], dim=2)
        return rows

    @staticmethod
    def concat(states: List["DecodingState"]) -> "DecodingState":
        """The rows of several states in one (streaming: a cohort that caught up, a refill that joins).

        States without per-row lengths must hold the same number of tokens; with per-row lengths any
        (the room of the widest).  Sources of different widths are left-padded (as the runner pads encoder
        outputs); a field some states lack (attention, a policy's extra) is zeros in their rows.
        """
        first = states[0]
        per_row = first.row_lengths is not None
        if any((s.row_lengths is not None) != per_row for s in states):
            raise ValueError("states with and without per-row lengths cannot be merged")
        if not per_row and any(s.length != first.length for s in states):
            raise ValueError("only states of equal length can be merged (or give them per-row lengths)")
        width = max(s.cum_scores.size(1) for s in states)  # token columns
        src_len = max(s.src_len for s in states)
        tokens = torch.cat([_pad_last(s.tokens, 1 + width, first.pad) for s in states])
        sentence, max_len = torch.cat([s.sentence for s in states]), torch.cat([s.max_len for s in states])
        encoder_out, cache = first.runner.merged_rows([s.encoder_out for s in states], [s.cache for s in states])
        merged = DecodingState(first.runner, tokens, sentence, max_len, encoder_out, cache, src_len)
        merged.cum_scores = torch.cat([_pad_last(s.cum_scores, width) for s in states])
        if any(s.attn is not None for s in states):
            like = next(s.attn for s in states if s.attn is not None)
            merged.attn = _cat_left_padded([  # (rows, src_len, width)
                _pad_last(like.new_zeros((s.rows, s.src_len, width)) if s.attn is None else s.attn, width)
                for s in states
            ])
        if per_row:
            merged.row_lengths = torch.cat([s.row_lengths for s in states])
            merged.pad = first.pad
        merged.source_extras = frozenset().union(*(s.source_extras for s in states))
        for name in {name for s in states for name in s.extra}:
            values = [s.extra.get(name) for s in states]
            like = next((v for v in values if v is not None), None)
            merged.extra[name] = None if like is None else torch.cat([
                like.new_zeros((s.rows,) + like.shape[1:]) if v is None else v for s, v in zip(states, values)
            ])
        return merged


def _pad_last(tensor: Tensor, size: int, value=0) -> Tensor:
    """``tensor`` right-padded with ``value`` to ``size`` in its last dimension."""
    extra = size - tensor.size(-1)
    return F.pad(tensor, (0, extra), value=value) if extra else tensor


def _cat_left_padded(attns):
    """Attention (rows_i, src_len_i, width) of several states, left-padded to the widest source."""
    src_len = max(a.size(1) for a in attns)
    padded = [F.pad(a, (0, 0, src_len - a.size(1), 0)) for a in attns]
    return torch.cat(padded)
