"""Blockwise decoding's per-row state: rows hold different numbers of accepted tokens, so the step
processors run per row step (``RowStepProcessors``) and every tensor is per row (``BlockwiseState``)."""

import copy
from typing import Optional

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_fastgen.sequence_generators.processors import ForbidPad, LengthLimits, UnkPenalty
from fairseq_fastgen.sequence_generators.state import DecodingState
from fairseq_fastgen.sequence_generators.streaming import CompanionFreeLayout


# ---- step processors for rows at different steps --------------------------------------------
class StepView:
    """What a step processor reads of rows that are all at the same step."""

    def __init__(self, tokens, sentence, max_len):
        self.tokens = tokens  # (rows, 1 + step): bos and the tokens before this step
        self.sentence = sentence  # (rows,)
        self.max_len = max_len  # (rows,)

    @property
    def length(self) -> int:
        return self.tokens.size(1) - 1


class RowStepProcessors:
    """Applies the generator's step processors (processors.py) to rows at different steps.

    Blockwise decoding scores several steps per row at once, and rows have
    accepted different numbers of tokens.  Processors that read only the scores
    run once on everything; the length limits run vectorized over per-row
    steps; any other processor (forced prefix, n-gram ban, ...) runs once per
    distinct step on the rows at that step, exactly as in greedy decoding.
    """

    def __init__(self, processors):
        self.processors = processors
        # whether some processor reads the tokens before a step (forced prefix, n-gram ban)
        self.reads_history = any(not isinstance(p, (ForbidPad, UnkPenalty, LengthLimits)) for p in processors)

    def __call__(self, lprobs, steps, history, row_of, sentence, max_len):
        """Edit ``lprobs`` (N, vocab) in place.

        steps: (N,) the step of each lprobs row; history: (rows, width) bos and
        tokens of each row (up to at least ``steps``; may be None unless
        ``reads_history``); row_of: (N,) the history row of each lprobs row;
        sentence, max_len: (rows,).
        """
        for processor in self.processors:
            if isinstance(processor, (ForbidPad, UnkPenalty)):  # read nothing but lprobs
                processor(lprobs, None)
            elif isinstance(processor, LengthLimits):
                processor.at_steps(lprobs, steps, max_len[row_of])
            else:
                for step in steps.unique().tolist():
                    at_step = steps.eq(step).nonzero().squeeze(1)
                    rows = row_of[at_step]
                    scores = lprobs[at_step]
                    processor(scores, StepView(history[rows, : step + 1], sentence[rows], max_len[rows]))
                    lprobs[at_step] = scores

    def one_row(self, lprobs, first_step: int, max_len: int):
        """Edit ``lprobs`` (m, vocab) of ONE row at the consecutive steps ``first_step`` ..
        ``first_step + m - 1`` in place, as ``__call__`` would, with Python integers for the steps
        and the row's ``max_len``. Only without processors that read the history."""
        assert not self.reads_history
        for processor in self.processors:
            if isinstance(processor, LengthLimits):
                processor.at_consecutive_steps(lprobs, first_step, max_len)
            else:  # ForbidPad, UnkPenalty: read nothing but lprobs
                processor(lprobs, None)


# ---- per-row state ---------------------------------------------------------------------------
class BlockwiseState:
    """Every per-row tensor of blockwise decoding; rows hold different numbers of tokens.

    Token ``t`` (0-based) of a row sits in column ``1 + t`` of ``tokens``
    (column 0 is bos); columns past the row's ``length`` hold padding.
    """

    def __init__(self, start: DecodingState, pad: int, rules: RowStepProcessors):
        self.rules = rules  # the decode's step processors, for rows at different steps
        self.pad = pad
        rows, capacity = start.rows, int(start.max_len.max()) + 1  # at most max_len tokens and eos
        self.runner = start.runner
        self.tokens = start.tokens.new_full((rows, 1 + capacity), pad)  # (rows, 1 + capacity)
        self.tokens[:, 0] = start.tokens[:, 0]
        self.length = start.tokens.new_zeros(rows)  # (rows,) accepted tokens
        self.cum_scores = start.cum_scores.new_zeros((rows, capacity))  # (rows, capacity)
        self.score = start.cum_scores.new_zeros(rows)  # (rows,) sum of the accepted tokens' lprobs
        self.attn: Optional[Tensor] = None  # (rows, src_len, capacity)
        self.sentence, self.max_len = start.sentence, start.max_len  # (rows,) each
        self.encoder_out, self.cache, self.src_len = start.encoder_out, start.cache, start.src_len
        # the next block: proposals (rows, block) from the heads at the last accepted
        # position; the first is greedy's next token, with its lprob and attention
        self.proposals: Optional[Tensor] = None
        self.first_lprob: Optional[Tensor] = None  # (rows,)
        self.first_attn: Optional[Tensor] = None  # (rows, src_len)
        # streaming: some rows joined before their first step (length -1) and run their bos in the next call
        self.has_fresh_rows = False

    @property
    def rows(self) -> int:
        return self.tokens.size(0)

    def accept(self, block, token_lprobs, token_attn, accepted):
        """Append to each row the tokens of ``block`` (rows, n) where ``accepted``
        (rows, n; a prefix of each row) holds; ``token_lprobs`` (rows, n) and
        ``token_attn`` (rows, n, src_len) or None belong to the block's tokens."""
        rows, offsets = accepted.nonzero(as_tuple=True)  # (accepted tokens,) each
        columns = self.length[rows] + offsets
        running, cumulative = self.score, []
        for offset in range(block.size(1)):  # one float addition per token, as greedy
            running = running + token_lprobs[:, offset]
            cumulative.append(running)
        cumulative = torch.stack(cumulative, dim=1)  # (rows, n)
        count = accepted.sum(dim=1)  # (rows,) >= 1, but 0 for a fresh row (streaming), which has run its bos
        self.tokens[rows, 1 + columns] = block[rows, offsets]
        self.cum_scores[rows, columns] = cumulative[rows, offsets]
        if self.has_fresh_rows:
            last_score = cumulative.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            self.score = torch.where(count > 0, last_score, self.score)
            self.length = self.length.clamp(min=0)  # a fresh row now holds its bos: no token yet
        else:
            self.score = cumulative.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
        if token_attn is not None:
            self.attention_buffer(token_attn)[rows, :, columns] = token_attn[rows, offsets]
        self.length = self.length + count

    def accept_one_row(self, block, count: int, length: int, token_lprobs, token_attn):
        """``accept`` for a lone row, with Python numbers: the first ``count`` tokens of ``block``
        (1, n), the row holding ``length`` tokens before; ``token_lprobs``: their lprobs (floats,
        float32 values); ``token_attn`` (count, src_len) or None."""
        cumulative = [numpy.float32(self.score.item())]
        for lprob in token_lprobs:  # one float32 addition per token, as greedy (numpy's float32 is IEEE's)
            cumulative.append(cumulative[-1] + numpy.float32(lprob))
        self.tokens[0, 1 + length: 1 + length + count] = block[0, :count]
        self.cum_scores[0, length: length + count] = torch.tensor(cumulative[1:], dtype=self.cum_scores.dtype)
        self.score = self.cum_scores[0, length + count - 1: length + count]  # (1,)
        if token_attn is not None:
            self.attention_buffer(token_attn)[0, :, length: length + count] = token_attn.t()
        self.length = self.length + count

    def attention_buffer(self, token_attn) -> Tensor:
        """``attn`` (rows, src_len, capacity), made on the first call from the first tokens'
        attention ``token_attn`` (..., src_len)."""
        if self.attn is None:
            self.attn = token_attn.new_zeros((self.rows, token_attn.size(-1), self.cum_scores.size(1)))
        return self.attn

    def select(self, index: Tensor):
        """Keep (and reorder to) the rows in ``index``."""
        for name in ("tokens", "length", "cum_scores", "score", "attn", "sentence", "max_len",
                     "proposals", "first_lprob", "first_attn"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index))
        self.encoder_out = self.runner.reorder_encoder_out(self.encoder_out, index)
        self.runner.reorder_cache(self.cache, index)

    @staticmethod
    def concat(states) -> "BlockwiseState":
        """The rows of several states (streaming: a refill joins the running rows), whatever their
        lengths: the runner right-aligns their cached positions; sources are right-padded to the widest."""
        width = max(s.src_len for s in states)
        for state in states:
            extra = width - state.src_len
            CompanionFreeLayout.widen(state, width)  # encoder output, cached keys/values and attn
            if state.first_attn is not None:
                state.first_attn = F.pad(state.first_attn, (0, extra))  # (rows, width)
        capacity = max(s.cum_scores.size(1) for s in states)
        merged = copy.copy(states[0])
        merged.tokens = torch.cat([F.pad(s.tokens, (0, 1 + capacity - s.tokens.size(1)), value=s.pad) for s in states])
        merged.cum_scores = torch.cat([F.pad(s.cum_scores, (0, capacity - s.cum_scores.size(1))) for s in states])
        if any(s.attn is not None for s in states):
            merged.attn = torch.cat([
                s.cum_scores.new_zeros((s.rows, width, capacity)) if s.attn is None
                else F.pad(s.attn, (0, capacity - s.attn.size(2))) for s in states
            ])  # (rows, width, capacity)
        if any(s.first_attn is not None for s in states):  # rows that have not run their bos have none yet
            for state in states:
                if state.first_attn is None:
                    state.first_attn = state.cum_scores.new_zeros((state.rows, width))
        for name in ("length", "score", "sentence", "max_len", "proposals", "first_lprob", "first_attn"):
            if getattr(merged, name) is not None:
                setattr(merged, name, torch.cat([getattr(s, name) for s in states]))
        merged.has_fresh_rows = any(s.has_fresh_rows for s in states)
        merged.encoder_out = merged.runner.concat_encoder_out([s.encoder_out for s in states])
        merged.cache = merged.runner.concat_caches([s.cache for s in states])
        return merged

    def finished_row(self, row: int) -> DecodingState:
        """Row ``row`` as a one-row DecodingState, for ``DecodeContext.hypothesis``."""
        length = int(self.length[row])
        view = DecodingState(
            self.runner, self.tokens[row:row + 1, : 1 + length], self.sentence[row:row + 1],
            self.max_len[row:row + 1], None, None, self.src_len,
        )
        view.cum_scores = self.cum_scores[row:row + 1, :length]
        if self.attn is not None:
            view.attn = self.attn[row:row + 1, :, :length]
        return view
