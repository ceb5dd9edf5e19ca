"""Step processors: each edits the next-token log-probabilities of a step.

They reproduce the rules of fairseq's SequenceGenerator so that every plugin
decoder honours the same generation options: no pad, the unk penalty, min and
max length, forced prefixes and no-repeat n-gram banning.  Every processor has one signature,
``processor(lprobs, rows)``: it edits ``lprobs`` (N, vocab) in place, reading what :class:`StepRows` says of
its N rows (their steps, length limits, sentences, tokens so far), whether the rows are all at one step (greedy,
beam searches), each at its own (blockwise verification, rows joined at other lengths) or one row at
consecutive steps (blockwise's lone row).
"""

import math
from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor

from fairseq_fastgen.ops.ngram_ban import ban_repeated_ngrams


NEG_INF = -math.inf


@dataclass
class StepRows:
    """The N rows of a step's log-probabilities (N, vocab), as processors read them.

    ``steps``: the tokens before each row's next one (bos not counted): an int where every row is at that step,
    a (N,) long tensor where rows are at steps of their own, or a ``range`` for ONE row at consecutive steps
    (Python integers: no small tensors on blockwise's batch-1 path); ``max_len``: (N,) long, an int with a range;
    ``sentence``: (N,) long pool positions; ``tokens``: (N, width) bos and each row's tokens up to at least its
    step.  ``sentence`` and ``tokens`` may be None where no processor reads them (``reads_tokens``)."""

    steps: Union[int, Tensor, range]
    max_len: Union[Tensor, int]
    sentence: Optional[Tensor] = None
    tokens: Optional[Tensor] = None

    @classmethod
    def of_state(cls, state) -> "StepRows":
        """Every row of a ``DecodingState`` whose rows hold one length."""
        return cls(state.length, state.max_len, state.sentence, state.tokens)

    def at(self, step: int, index: Tensor) -> "StepRows":
        """Rows ``index`` (M,), all at ``step``, with their tokens up to it."""
        return StepRows(step, self.max_len[index], self.sentence[index], self.tokens[index, : step + 1])


def at_each_step(processor, lprobs: Tensor, rows: StepRows):
    """``processor`` over rows at steps of their own: once per distinct step, on the rows at that step, as greedy
    decoding would at that step (the processors that read the tokens)."""
    if isinstance(rows.steps, range):
        raise ValueError(f"{type(processor).__name__} reads the tokens: give the rows' steps as a tensor")
    for step in rows.steps.unique().tolist():
        index = rows.steps.eq(step).nonzero().squeeze(1)  # (M,)
        scores = lprobs[index]
        processor(scores, rows.at(step, index))
        lprobs[index] = scores


class ForbidPad:
    reads_tokens = False

    def __init__(self, pad):
        self.pad = pad

    def __call__(self, lprobs, rows: StepRows):
        lprobs.nan_to_num_(nan=NEG_INF, posinf=math.inf, neginf=NEG_INF)  # as stock: a NaN never wins
        lprobs[:, self.pad] = NEG_INF


class UnkPenalty:
    reads_tokens = False

    def __init__(self, unk, penalty):
        self.unk, self.penalty = unk, penalty

    def __call__(self, lprobs, rows: StepRows):
        lprobs[:, self.unk] -= self.penalty


class LengthLimits:
    """eos is banned before ``min_len`` tokens and forced at the row's ``max_len``.

    As in fairseq, the minimum length does not apply while a prefix is forced.
    """

    reads_tokens = False

    def __init__(self, eos, min_len, prefix_len=0):
        self.eos, self.min_len, self.prefix_len = eos, min_len, prefix_len

    def __call__(self, lprobs, rows: StepRows):
        if isinstance(rows.steps, range):
            self.at_consecutive_steps(lprobs, rows.steps.start, rows.max_len)
        elif isinstance(rows.steps, Tensor):
            self.at_steps(lprobs, rows.steps, rows.max_len)
        else:
            self.at_one_step(lprobs, rows.steps, rows.max_len)

    def at_one_step(self, lprobs, step: int, max_len):
        """lprobs (N, vocab), every row at ``step``; max_len (N,) long."""
        if self.prefix_len <= step < self.min_len:
            lprobs[:, self.eos] = NEG_INF
        at_limit = max_len <= step  # (N,)
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

    reads_tokens = True  # the rows' sentences and steps

    def __init__(self, prefix_tokens, pad):
        self.prefix_tokens = prefix_tokens  # (sentences, prefix_len) long
        self.pad = pad

    def __call__(self, lprobs, rows: StepRows):
        if not isinstance(rows.steps, int):
            return at_each_step(self, lprobs, rows)
        step = rows.steps
        if step >= self.prefix_tokens.size(1):
            return
        forced = self.prefix_tokens[rows.sentence, step]  # (N,)
        index = (forced.ne(self.pad) & rows.max_len.gt(step)).nonzero().squeeze(1)
        if index.numel() == 0:
            return
        kept = lprobs[index, forced[index]].clone()
        lprobs[index] = NEG_INF
        lprobs[index, forced[index]] = kept


class BanRepeatedNgrams:
    """--no-repeat-ngram-size: torch on CPU, the CuPy kernel on CUDA (see ops/)."""

    reads_tokens = True

    def __init__(self, n):
        self.n = n

    def __call__(self, lprobs, rows: StepRows):
        if not isinstance(rows.steps, int):
            return at_each_step(self, lprobs, rows)
        ban_repeated_ngrams(rows.tokens, lprobs, step=rows.steps, n=self.n)


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


def apply_processors(processors, lprobs, rows: StepRows):
    """Every processor in turn on ``lprobs`` (N, vocab), in place; returns it."""
    for processor in processors:
        processor(lprobs, rows)
    return lprobs


def reads_tokens(processors) -> bool:
    """Whether some processor reads the rows' tokens or sentences (a forced prefix, an n-gram ban)."""
    return any(processor.reads_tokens for processor in processors)


def row_max_len(source_widths, gen_cfg, max_positions):
    """Per-sentence length limit ``min(int(max_len_a * width + max_len_b), max_positions - 1)``.

    ``source_widths`` (sentences,): each source's tokens without padding, its eos included.  Stock fairseq
    takes the width of the batch's source tensor (``src_tokens.size(1)``: the longest source, eos included),
    so at batch 1 the two limits agree; per sentence keeps results independent of batching."""
    # in double precision, as fairseq's Python arithmetic: in float32 int(0.7 * 90) would be 63, not 62
    limit = (gen_cfg.max_len_a * source_widths.double() + gen_cfg.max_len_b).long()
    return limit.clamp(max=max_positions - 1)
