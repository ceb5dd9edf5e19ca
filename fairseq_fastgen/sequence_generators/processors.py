"""Step processors: each edits the next-token log-probabilities of a step.

They reproduce the rules of fairseq's SequenceGenerator so that every plugin
decoder honours the same generation options: no pad, the unk penalty, min and
max length, forced prefixes and no-repeat n-gram banning.  A processor gets
``lprobs`` (rows, vocab) and the :class:`DecodingState` (whose ``tokens`` hold
bos plus the tokens generated so far) and edits ``lprobs`` in place.
:class:`RowStepProcessors` applies them to rows at steps of their own (blockwise decoding).
"""

import math

import torch

from fairseq_fastgen.sequence_generators.state import DecodingState


NEG_INF = -math.inf


class ForbidPad:
    def __init__(self, pad):
        self.pad = pad

    def __call__(self, lprobs, state):
        lprobs.nan_to_num_(nan=NEG_INF, posinf=math.inf, neginf=NEG_INF)  # as stock: a NaN never wins
        lprobs[:, self.pad] = NEG_INF


class UnkPenalty:
    def __init__(self, unk, penalty):
        self.unk, self.penalty = unk, penalty

    def __call__(self, lprobs, state):
        lprobs[:, self.unk] -= self.penalty


class LengthLimits:
    """eos is banned before ``min_len`` tokens and forced at the row's ``max_len``.

    As in fairseq, the minimum length does not apply while a prefix is forced.
    ``__call__`` applies the rule to rows all at one step; ``at_steps`` and
    ``at_consecutive_steps`` to rows at steps of their own (blockwise decoding).
    """

    def __init__(self, eos, min_len, prefix_len=0):
        self.eos, self.min_len, self.prefix_len = eos, min_len, prefix_len

    def __call__(self, lprobs, state):
        step = state.length
        if self.prefix_len <= step < self.min_len:
            lprobs[:, self.eos] = NEG_INF
        at_limit = state.max_len <= step  # (rows,)
        if at_limit.any():
            self.only_eos(lprobs, at_limit)

    def at_steps(self, lprobs, steps, max_len):
        """lprobs (N, vocab), each row at its own step: steps, max_len (N,) long."""
        if self.min_len > self.prefix_len:  # else no step is too short
            too_short = (steps >= self.prefix_len) & (steps < self.min_len)  # (N,)
            lprobs[:, self.eos].masked_fill_(too_short, NEG_INF)  # the eos column, in place: no index of rows
        at_limit = max_len <= steps
        if at_limit.any():
            self.only_eos(lprobs, at_limit)

    def at_consecutive_steps(self, lprobs, first_step: int, max_len: int):
        """lprobs (m, vocab) of one row at the steps ``first_step`` .. ``first_step + m - 1``
        (Python integers: no tensor is made for the steps)."""
        m = lprobs.size(0)
        short_from, short_to = max(self.prefix_len, first_step), min(self.min_len, first_step + m)
        if short_from < short_to:  # the steps where eos would come too early
            lprobs[short_from - first_step: short_to - first_step, self.eos] = NEG_INF
        at_limit = max(max_len - first_step, 0)  # the first row whose step is >= max_len
        if at_limit < m:
            self.only_eos(lprobs, slice(at_limit, None))

    def only_eos(self, lprobs, rows):
        """Rows ``rows`` (a mask or a slice) of lprobs may only produce eos, at its score."""
        eos_scores = lprobs[rows, self.eos].clone()
        lprobs[rows] = NEG_INF
        lprobs[rows, self.eos] = eos_scores


class ForcePrefix:
    """Rows whose sentence has a forced prefix token at this step may only produce it."""

    def __init__(self, prefix_tokens, pad):
        self.prefix_tokens = prefix_tokens  # (sentences, prefix_len) long
        self.pad = pad

    def __call__(self, lprobs, state):
        step = state.length
        if step >= self.prefix_tokens.size(1):
            return
        forced = self.prefix_tokens[state.sentence, step]  # (rows,)
        rows = (forced.ne(self.pad) & state.max_len.gt(step)).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        kept = lprobs[rows, forced[rows]].clone()
        lprobs[rows] = NEG_INF
        lprobs[rows, forced[rows]] = kept


class BanRepeatedNgrams:
    """--no-repeat-ngram-size: torch on CPU, the CuPy kernel on CUDA (see ops/)."""

    def __init__(self, n):
        from fairseq_fastgen.ops.ngram_ban import ban_repeated_ngrams

        self.n = n
        self.ban = ban_repeated_ngrams

    def __call__(self, lprobs, state):
        self.ban(state.tokens, lprobs, step=state.length, n=self.n)


def build_processors(tgt_dict, gen_cfg, prefix_tokens=None):
    """The processors implied by fairseq's generation options, in stock order."""
    processors = [ForbidPad(tgt_dict.pad())]
    if gen_cfg.unkpen:
        processors.append(UnkPenalty(tgt_dict.unk(), gen_cfg.unkpen))
    has_prefix = prefix_tokens is not None and prefix_tokens.numel() > 0
    processors.append(LengthLimits(tgt_dict.eos(), gen_cfg.min_len, prefix_tokens.size(1) if has_prefix else 0))
    if has_prefix:
        processors.append(ForcePrefix(prefix_tokens, tgt_dict.pad()))
    if gen_cfg.no_repeat_ngram_size > 0:
        processors.append(BanRepeatedNgrams(gen_cfg.no_repeat_ngram_size))
    return processors


def apply_processors(processors, lprobs, state):
    for processor in processors:
        processor(lprobs, state)
    return lprobs


class RowStepProcessors:
    """Applies the generator's step processors to rows at different steps.

    Blockwise decoding scores several steps per row at once, and rows have
    accepted different numbers of tokens.  Processors that read only the scores
    run once on everything; the length limits run vectorized over per-row
    steps; any other processor (forced prefix, n-gram ban, ...) runs once per
    distinct step on the rows at that step (a DecodingState of their history,
    without model buffers), exactly as in greedy decoding.
    """

    def __init__(self, processors):
        self.processors = processors
        # whether some processor reads the tokens before a step (forced prefix, n-gram ban)
        self.reads_history = any(not isinstance(p, (ForbidPad, UnkPenalty, LengthLimits)) for p in processors)

    def __call__(self, lprobs, steps, history, row_of, sentence, max_len):
        """Edit ``lprobs`` (N, vocab) in place.

        steps: (N,) the step of each lprobs row; history: (rows, width) bos and
        tokens of each row (up to at least ``steps``; may be None unless
        ``reads_history``); row_of: (N,) the history row of each lprobs row, or
        None where lprobs row i is row i (one step per row);
        sentence, max_len: (rows,).
        """
        if row_of is None and self.reads_history:
            row_of = torch.arange(lprobs.size(0), device=lprobs.device)
        for processor in self.processors:
            if isinstance(processor, (ForbidPad, UnkPenalty)):  # read nothing but lprobs
                processor(lprobs, None)
            elif isinstance(processor, LengthLimits):
                processor.at_steps(lprobs, steps, max_len if row_of is None else max_len[row_of])
            else:
                for step in steps.unique().tolist():
                    at_step = steps.eq(step).nonzero().squeeze(1)
                    rows = row_of[at_step]
                    scores = lprobs[at_step]
                    at = DecodingState(None, history[rows, : step + 1], sentence[rows], max_len[rows], None, None, 0)
                    processor(scores, at)
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


def row_max_len(source_widths, gen_cfg, max_positions):
    """Per-sentence length limit ``min(int(max_len_a * width + max_len_b), max_positions - 1)``.

    ``source_widths`` (sentences,): each source's tokens without padding, its eos included.  Stock fairseq
    takes the width of the batch's source tensor (``src_tokens.size(1)``: the longest source, eos included),
    so at batch 1 the two limits agree; per sentence keeps results independent of batching."""
    # in double precision, as fairseq's Python arithmetic: in float32 int(0.7 * 90) would be 63, not 62
    limit = (gen_cfg.max_len_a * source_widths.double() + gen_cfg.max_len_b).long()
    return limit.clamp(max=max_positions - 1)
