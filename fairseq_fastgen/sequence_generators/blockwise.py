"""Blockwise parallel decoding (Stern, Shazeer and Uszkoreit, 2018).

A ``transformer_khead`` model proposes, at every position, the next k tokens
(head i: the token i positions ahead).  Decoding alternates three steps:

* **predict**: the heads at the last accepted position propose a block of k
  tokens; the first comes from head 1 (p_1), so it is exactly greedy's next token;
* **verify**: ONE decoder pass feeds the k proposed tokens (each row against its
  own incremental cache, causal among the new positions) and scores each with
  p_1: proposal j + 1 is checked against p_1 after proposal j;
* **accept**: every row keeps the longest verified prefix of its block (at
  least one token).  The same pass already holds every head's output at the
  last accepted position: the next block's proposals cost no extra model call.

So after the first (bos) step, each iteration is one model invocation over at
most k new positions.  The self-attention cache keeps only accepted positions:
rejected ones are dropped after each pass (the runner's ``keep_accepted``).

Acceptance is exact by default: a proposal is accepted iff it is greedy's
choice (argmax of p_1 after the step processors), so the output is the greedy
output of head 1.  ``--blockwise-top-k``, ``--blockwise-epsilon`` and
``--blockwise-min-block`` accept more, approximately (see the options).
"""

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.dataclass import FairseqDataclass

from fairseq_fastgen.option_checks import UsageError, require_finite_in_range, require_int
from fairseq_fastgen.sequence_generators.counters import GenerationCounters
from fairseq_fastgen.sequence_generators.generator import FastgenGenerator, one_hypothesis_per_sentence
from fairseq_fastgen.sequence_generators.int8_proposals import Int8Proposer
from fairseq_fastgen.sequence_generators.processors import ForbidPad, LengthLimits, UnkPenalty
from fairseq_fastgen.sequence_generators.registry import option_value, register_decoder
from fairseq_fastgen.sequence_generators.state import DecodingState
from fairseq_fastgen.sequence_generators.streaming import CompanionFreeLayout, StreamingScheduler, prepare_streaming_cli


@dataclass
class BlockwiseOptions(FairseqDataclass):
    blockwise_block_size: Optional[int] = field(
        default=None,
        metadata={"help": "blockwise: tokens proposed per iteration, at most the model's number of heads "
                          "(default: all of them)"},
    )
    blockwise_top_k: int = field(
        default=0,
        metadata={"help": "blockwise: accept a proposed token if it is among the N most probable tokens of "
                          "head 1 (approximate; 0: exact acceptance, identical to greedy)"},
    )
    blockwise_epsilon: Optional[float] = field(
        default=None,
        metadata={"help": "blockwise: accept a proposed ordinal symbol whose value differs by at most E from "
                          "head 1's choice (approximate; see --blockwise-ordinal-symbols)"},
    )
    blockwise_ordinal_symbols: str = field(
        default=r"^-?[0-9]+$",
        metadata={"help": "blockwise: regular expression selecting the target symbols that are numbers "
                          "(ordinal symbols) for --blockwise-epsilon; their value is the number they spell"},
    )
    blockwise_min_block: int = field(
        default=1,
        metadata={"help": "blockwise: accept at least this many proposed tokens per iteration, verified or "
                          "not (approximate when > 1)"},
    )
    blockwise_int8_proposals: bool = field(
        default=False,
        metadata={"help": "blockwise: compute the proposals of heads 2..k from int8 copies of the k-head layer "
                          "and the output projection (CPU only). Head 1 still verifies in full precision, so "
                          "exact acceptance keeps greedy's output; faster at small batches on the CPU. With "
                          "--blockwise-top-k/-epsilon/-min-block the output may change"},
    )


# ---- acceptance criteria: is a proposed token good enough, given p_1 there? ------------------
class ExactMatch:
    """The proposal must be greedy's choice."""

    def accepts(self, proposed: Tensor, lprobs: Tensor, best: Tensor) -> Tensor:
        """proposed, best: (rows, m); lprobs: (rows, m, vocab) -> (rows, m) bool."""
        return proposed.eq(best)


class TopK:
    """The proposal must be among the ``k`` most probable tokens of p_1 (and allowed)."""

    def __init__(self, k):
        self.k = k

    def accepts(self, proposed, lprobs, best):
        top = lprobs.topk(min(self.k, lprobs.size(-1)), dim=-1).indices  # (rows, m, k)
        allowed = lprobs.gather(2, proposed.unsqueeze(2)).squeeze(2) > -math.inf
        return top.eq(proposed.unsqueeze(2)).any(dim=2) & allowed


class OrdinalDistance:
    """Both tokens ordinal symbols whose values differ by at most ``epsilon`` (or equal tokens)."""

    def __init__(self, values: Tensor, epsilon: float):
        self.values = values  # (vocab,) float: the value of each ordinal symbol, nan for the others
        self.epsilon = epsilon

    def accepts(self, proposed, lprobs, best):
        values = self.values.to(proposed.device)
        close = (values[proposed] - values[best]).abs() <= self.epsilon  # nan: False
        allowed = lprobs.gather(2, proposed.unsqueeze(2)).squeeze(2) > -math.inf
        return proposed.eq(best) | (close & allowed)


def ordinal_values(tgt_dict, pattern: str) -> Tensor:
    """Value of every target symbol matching ``pattern`` (nan for the others)."""
    matcher = re.compile(pattern)
    values = torch.full((len(tgt_dict),), math.nan)
    for index, symbol in enumerate(tgt_dict.symbols):
        if matcher.search(symbol):
            try:
                values[index] = float(symbol)
            except ValueError as error:
                raise ValueError(
                    f"--blockwise-ordinal-symbols {pattern!r} matches {symbol!r}, which is not a number"
                ) from error
    if torch.isnan(values).all():
        raise ValueError(f"--blockwise-ordinal-symbols {pattern!r} matches no symbol of the target dictionary")
    return values


def build_acceptance(gen_cfg, tgt_dict):
    top_k = option_value(gen_cfg, "blockwise_top_k")
    epsilon = option_value(gen_cfg, "blockwise_epsilon")
    if top_k and epsilon is not None:
        raise ValueError("--blockwise-top-k and --blockwise-epsilon are alternative acceptance criteria; give one")
    require_int("--blockwise-top-k", top_k, 0)
    if top_k:
        return TopK(top_k)
    if epsilon is not None:
        epsilon = require_finite_in_range("--blockwise-epsilon", epsilon, 0)  # NaN: nothing would be close
        return OrdinalDistance(ordinal_values(tgt_dict, option_value(gen_cfg, "blockwise_ordinal_symbols")), epsilon)
    return ExactMatch()


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


# ---- the search policy -----------------------------------------------------------------------
class BlockwisePolicy:
    """Predict / verify / accept; one model invocation per iteration after the first step."""

    def __init__(self, decoder, block_size, acceptance, min_block, pad, int8_proposals=False):
        self.decoder = decoder  # KHeadTransformerDecoder
        self.block_size = block_size
        self.acceptance = acceptance
        self.min_block = min_block
        self.pad = pad
        self.proposer = Int8Proposer(decoder) if int8_proposals else None
        # a lone row with exact acceptance takes advance_one_row: the same computation with Python
        # integers in place of the small tensors of per-row bookkeeping (batch 1, a batch's last row)
        self.one_row_path = isinstance(acceptance, ExactMatch) and min_block == 1

    joins_lengths = True  # streaming: a refill's rows join the running ones, whatever their lengths

    @staticmethod
    def join(states):
        """Streaming: every state's rows in one (a list of at most one state)."""
        return [BlockwiseState.concat(states)] if len(states) > 1 else states

    def start(self, state: DecodingState, ctx) -> BlockwiseState:
        """Run the bos position; its heads propose the first block."""
        blockwise = BlockwiseState(state, self.pad, RowStepProcessors(ctx.processors))
        positions = state.tokens.new_zeros((state.rows, 1))
        features, attn = self.run_block(blockwise, state.tokens, positions, ctx)  # (rows, 1, dim)
        base = features[:, 0]  # (rows, dim)
        heads = None if self.decoder.heads.identity_first else self.heads(base)  # (rows, block, dim)
        first_lprobs = self.log_probs(base if heads is None else heads[:, 0], ctx)  # (rows, vocab)
        rows = torch.arange(blockwise.rows, device=positions.device)
        blockwise.rules(first_lprobs, blockwise.length, blockwise.tokens, rows, blockwise.sentence, blockwise.max_len)
        self.propose(blockwise, ctx, first_lprobs, None if attn is None else attn[:, 0],
                     self.later_scores(base, heads, ctx))
        return blockwise

    def start_joining(self, state: DecodingState, ctx) -> BlockwiseState:
        """Streaming: rows about to join running ones.  Where the runner takes rows into a cache before
        their first step, their bos position runs in the running rows' next call (a block of the bos and
        padding, marked by length -1); else ``start`` runs it in a call of its own."""
        if not state.runner.joins_rows_before_their_first_step:
            return self.start(state, ctx)
        blockwise = BlockwiseState(state, self.pad, RowStepProcessors(ctx.processors))
        state.runner.start_cache(blockwise.cache, blockwise.encoder_out)
        blockwise.length = blockwise.length - 1  # the next block starts at the bos position
        blockwise.has_fresh_rows = True
        blockwise.proposals = blockwise.tokens.new_full((blockwise.rows, self.block_size), self.pad)
        blockwise.proposals[:, 0] = state.tokens[:, 0]  # (rows, block): the bos, then padding
        blockwise.first_lprob = blockwise.cum_scores.new_zeros(blockwise.rows)  # read only for accepted tokens
        return blockwise

    def advance(self, state: BlockwiseState, ctx):
        if state.rows == 1 and self.one_row_path and not state.rules.reads_history and not state.has_fresh_rows:
            self.advance_one_row(state, ctx)
            return
        rows = torch.arange(state.rows, device=state.tokens.device)
        remaining = int((state.max_len + 1 - state.length).max())  # tokens a row may still take, eos included
        block = state.proposals[:, : min(self.block_size, remaining)]  # (rows, n)
        n = block.size(1)
        offsets = torch.arange(n, device=block.device)
        positions = (state.length.unsqueeze(1) + 1 + offsets).clamp(max=self.decoder.max_positions() - 1)
        features, attn, all_heads, lprobs = self.score_block(state, block, positions, ctx)
        rules = state.rules
        history = None
        if rules.reads_history:
            history = torch.cat([state.tokens, block.new_full((state.rows, n), self.pad)], dim=1)
            history[rows.unsqueeze(1), 1 + state.length.unsqueeze(1) + offsets] = block
        steps = (state.length.unsqueeze(1) + 1 + offsets).view(-1)  # (rows * n,)
        flat = lprobs.view(-1, lprobs.size(-1))
        row_of = rows.unsqueeze(1).expand(-1, n).reshape(-1)  # (rows * n,)
        rules(flat, steps, history, row_of, state.sentence, state.max_len)
        best = lprobs.topk(1, dim=-1).indices.squeeze(2)  # (rows, n): greedy's choice after each block token
        accepted = self.accepted_prefix(block, lprobs, best, ctx.eos)  # (rows, n)
        kept, fresh = accepted, None  # (rows, n) the positions the cache keeps: a fresh row's bos
        if state.has_fresh_rows:
            fresh = state.length.lt(0)  # (rows,) rows whose block is their bos (streaming: they joined just now)
            kept = torch.where(fresh.unsqueeze(1), offsets.eq(0).unsqueeze(0), accepted)
            accepted = accepted & ~fresh.unsqueeze(1)  # a fresh row accepts no token yet
        count = kept.sum(dim=1)  # (rows,) >= 1

        token_lprobs = torch.cat(
            [state.first_lprob.unsqueeze(1), lprobs[:, :-1].gather(2, block[:, 1:].unsqueeze(2)).squeeze(2)], dim=1
        )  # (rows, n)
        token_attn = None if attn is None else torch.cat([state.first_attn.unsqueeze(1), attn[:, :-1]], dim=1)
        state.accept(block, token_lprobs, token_attn, accepted)
        state.runner.keep_accepted(state.cache, kept)

        last = count - 1  # the last accepted position proposes the next block (a fresh row's bos, its first)
        finished = block[rows, last].eq(ctx.eos)
        if fresh is not None:
            finished &= ~fresh
            state.has_fresh_rows = False  # accept() gave them length 0
        finished_rows = finished.nonzero().squeeze(1).tolist()
        for row in finished_rows:
            ctx.finish(int(state.sentence[row]), [ctx.hypothesis(state.finished_row(row), 0)])
        alive = rows  # (rows,) the rows that go on
        if finished_rows:
            alive = (~finished).nonzero().squeeze(1)
            state.select(alive)
            last = last[alive]
        if state.rows == 0:
            return
        first_lprobs = lprobs[alive, last]  # (rows, vocab), already processed
        first_attn = None if attn is None else attn[alive, last]
        heads = None if all_heads is None else all_heads[alive, last]  # (rows, block, dim)
        self.propose(state, ctx, first_lprobs, first_attn, self.later_scores(features[alive, last], heads, ctx))

    def advance_one_row(self, state: BlockwiseState, ctx):
        """``advance`` for a single row, exact acceptance, no processor reading the history:
        the same products and the same float operations on the scores (so bitwise the same
        hypotheses), with the acceptance, the row's steps and its length limits in Python."""
        length, max_len = int(state.length[0]), int(state.max_len[0])
        n = min(self.block_size, max_len + 1 - length)  # tokens it may still take, eos included
        block = state.proposals[:, :n]  # (1, n)
        positions = torch.arange(length + 1, length + 1 + n, device=block.device)
        positions = positions.clamp_(max=self.decoder.max_positions() - 1).unsqueeze(0)  # (1, n)
        features, attn, all_heads, lprobs = self.score_block(state, block, positions, ctx)
        state.rules.one_row(lprobs[0], length + 1, max_len)
        top_lprobs, top = lprobs[0].topk(1, dim=-1)  # (n, 1) each: greedy's choice after each block token
        proposed = block[0].tolist()
        count = self.accepted_count(proposed, top.view(-1).tolist(), ctx.eos)

        token_lprobs = [state.first_lprob.item()]  # the accepted tokens' lprobs
        if count > 1:
            verified = lprobs[0, torch.arange(count - 1, device=block.device), block[0, 1:count]]  # (count - 1,)
            token_lprobs += verified.tolist()
        token_attn = None if attn is None else torch.cat([state.first_attn, attn[0, : count - 1]])  # (count, src_len)
        state.accept_one_row(block, count, length, token_lprobs, token_attn)
        if count < n:  # drop the rejected positions from the self-attention cache
            state.runner.drop_last_positions(state.cache, n - count)

        last = count - 1  # the last accepted position proposes the next block
        if proposed[last] == ctx.eos:
            ctx.finish(int(state.sentence[0]), [ctx.hypothesis(state.finished_row(0), 0)])
            state.select(state.length.new_zeros(0))
            return
        heads = None if all_heads is None else all_heads[:, last]  # (1, block, dim)
        later = self.later_scores(features[:, last], heads, ctx)  # (1, block - 1, vocab) or None
        first = top[last: last + 1]  # (1, 1): greedy's next token, from the processed lprobs at ``last``
        state.first_lprob, state.first_attn = top_lprobs[last], None if attn is None else attn[:, last]
        if later is None:  # a block of 1
            state.proposals = first
            return
        state.rules.one_row(later[0], length + count + 1, max_len)
        state.proposals = torch.cat([first, later[0].topk(1, dim=-1).indices.view(1, -1)], dim=1)  # (1, block)

    def score_block(self, state, block, positions, ctx):
        """One decoder pass over each row's ``block`` (rows, n) at ``positions`` (rows, n), and head 1's
        verification scores: p_1 after block token j scores block token j + 1. Returns the decoder
        features (rows, n, dim), attention (rows, n, src_len) or None, every head (rows, n, block, dim)
        where computed in full precision (None with an identity head 1: the k-head layer then runs
        only where proposals are read) and head 1's lprobs (rows, n, vocab), not yet processed."""
        features, attn = self.run_block(state, block, positions, ctx)
        ctx.counters.add("row_iterations", state.rows)
        all_heads = None if self.decoder.heads.identity_first else self.heads(features)
        lprobs = self.log_probs(features if all_heads is None else all_heads[:, :, 0], ctx)
        return features, attn, all_heads, lprobs

    @staticmethod
    def accepted_count(proposed, best, eos) -> int:
        """``accepted_prefix`` of one row with exact acceptance, in Python: how many tokens of the
        block ``proposed`` (list) to accept, given greedy's choice ``best`` (list) after each."""
        count = 1  # the first is greedy's own choice; then the longest verified prefix, nothing after an eos
        while count < len(proposed) and proposed[count - 1] != eos and proposed[count] == best[count - 1]:
            count += 1
        return count

    def accepted_prefix(self, block, lprobs, best, eos) -> Tensor:
        """(rows, n) bool: the tokens of each row's block that are accepted (a prefix)."""
        verified = self.acceptance.accepts(block[:, 1:], lprobs[:, :-1], best[:, :-1])  # (rows, n - 1)
        ok = torch.cat([verified.new_ones((block.size(0), 1)), verified], dim=1)
        if self.min_block > 1:
            ok |= torch.arange(block.size(1), device=block.device).lt(self.min_block).unsqueeze(0)
        is_eos = block.eq(eos)
        ok &= (is_eos.cumsum(dim=1) - is_eos.long()).eq(0)  # nothing after an eos
        return ok.long().cumprod(dim=1).bool()

    def later_scores(self, base, heads, ctx):
        """Scores (rows, block - 1, vocab) of heads 2.. at decoder outputs ``base`` (rows, dim): their
        logits, as the runner scales them. Only their argmax is read, after the step processors, and
        a log-softmax would shift each row without moving it (the processors mask or shift columns).

        ``heads`` (rows, block, dim): their heads where already computed in full
        precision (a model without identity-first), else None.
        """
        if self.block_size == 1:
            return None
        if self.proposer is None:
            heads = self.heads(base) if heads is None else heads
            return self.log_probs(heads[:, 1:], ctx, normalize=False)
        if not self.proposer.is_current(self.decoder):  # the model's weights changed since the int8 copy
            self.proposer = Int8Proposer(self.decoder)
        later = self.proposer.later_heads(base) if heads is None else heads[:, 1:]  # (rows, k - 1, dim)
        return self.log_probs(later[:, : self.block_size - 1], ctx, project=self.proposer.logits, normalize=False)

    def propose(self, state: BlockwiseState, ctx, first_lprobs, first_attn, later_scores):
        """Set the next block: greedy's token from ``first_lprobs`` (rows, vocab),
        processed) then one token per later head from ``later_scores`` (rows,
        block - 1, vocab), each processed with the proposals before it as context."""
        first_lprob, first = first_lprobs.topk(1, dim=-1)  # (rows, 1) each
        state.first_lprob = first_lprob.squeeze(1)
        state.first_attn = first_attn
        if self.block_size == 1:
            state.proposals = first
            return
        rules = state.rules
        if rules.reads_history:
            state.proposals = self.propose_in_turn(state, rules, first, later_scores)
            return
        # no processor reads earlier tokens: every later head is processed at once, at its own step
        later = self.block_size - 1
        rows = torch.arange(state.rows, device=first.device)
        steps = (state.length.unsqueeze(1) + 1 + torch.arange(later, device=first.device)).view(-1)  # (rows * later,)
        flat = later_scores.reshape(-1, later_scores.size(-1))  # (rows * later, vocab)
        rules(flat, steps, None, rows.unsqueeze(1).expand(-1, later).reshape(-1), state.sentence, state.max_len)
        best = flat.topk(1, dim=-1).indices.view(state.rows, later)  # (rows, later), ties as propose_in_turn
        state.proposals = torch.cat([first, best], dim=1)  # (rows, block)

    def propose_in_turn(self, state, rules, first, later_scores):
        """Proposals (rows, block), each later head processed with the proposals before it as history."""
        rows = torch.arange(state.rows, device=first.device)
        history = torch.cat([state.tokens, state.tokens.new_full((state.rows, self.block_size), self.pad)], dim=1)
        history[rows, 1 + state.length] = first.squeeze(1)
        for head in range(1, self.block_size):
            scores = later_scores[:, head - 1]
            rules(scores, state.length + head, history, rows, state.sentence, state.max_len)
            history[rows, 1 + state.length + head] = scores.topk(1, dim=-1).indices.squeeze(1)
        columns = 1 + state.length.unsqueeze(1) + torch.arange(self.block_size, device=rows.device)
        return history[rows.unsqueeze(1), columns]  # (rows, block)

    # ---- the model ---------------------------------------------------------------------------
    def heads(self, features):
        """The first ``block_size`` heads (..., block, dim) of decoder outputs (..., dim)."""
        return self.decoder.heads(features)[..., : self.block_size, :]

    def run_block(self, state, tokens, positions, ctx):
        features, attn = state.runner.step_block(tokens, positions, state.encoder_out, state.cache)
        ctx.counters.add("model_calls")
        return features, attn

    @staticmethod
    def log_probs(features, ctx, project=None, normalize=True):
        """Log-probabilities (..., vocab) of head features (rows, dim) or (rows, n, dim), from the runner
        (``project``: features -> logits in place of the model's projection; ``normalize=False``: the scaled
        logits, without the log-softmax)."""
        squeeze = features.dim() == 2
        # contiguous: the decoder's output is a transposed view, on which a 3-D linear is several times slower
        features = features.unsqueeze(1) if squeeze else features.contiguous()  # (rows, n, dim)
        lprobs = ctx.runner.project(features, project, normalize)
        return lprobs[:, 0] if squeeze else lprobs


class BlockwiseCounters(GenerationCounters):
    """Adds ``mean_accepted_block_size``: tokens per row and iteration."""

    def extra_stats(self):
        row_iterations = self.counts["row_iterations"]
        return {"mean_accepted_block_size": self.counts["tokens"] / row_iterations} if row_iterations else {}


@register_decoder(
    "blockwise", options=BlockwiseOptions,
    guarantee="blockwise parallel decoding of a transformer_khead model; exact acceptance (default) is "
              "token-identical to greedy decoding with head 1, --blockwise-top-k/-epsilon/-min-block approximate",
)
class BlockwiseGenerator(FastgenGenerator):
    """Blockwise parallel decoding with a k-head model (see the module docstring)."""

    name = "blockwise"

    def new_counters(self):
        return BlockwiseCounters(self.name)

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        decoder = model.decoder
        if not hasattr(decoder, "forward_block"):
            raise ValueError(
                f"--decoder {cls.name} needs a k-head model (--arch transformer_khead); this checkpoint's decoder is "
                f"{type(decoder).__name__}"
            )
        block_size = option_value(gen_cfg, "blockwise_block_size")
        if block_size is None:  # default: every head (0 is refused, not read as this default)
            block_size = decoder.block_size
        if require_int("--blockwise-block-size", block_size, 1) > decoder.block_size:
            raise ValueError(
                f"--blockwise-block-size {block_size}: the model has {decoder.block_size} heads (--block-size of "
                f"transformer_khead); give 1 .. {decoder.block_size}"
            )
        min_block = option_value(gen_cfg, "blockwise_min_block")
        require_int("--blockwise-min-block", min_block, 1)
        policy = BlockwisePolicy(decoder, block_size, build_acceptance(gen_cfg, tgt_dict), min_block, tgt_dict.pad(),
                                 int8_proposals=option_value(gen_cfg, "blockwise_int8_proposals"))
        return cls(model, tgt_dict, gen_cfg, policy, cls.scheduler_for(gen_cfg), projection=projection)

    @staticmethod
    def scheduler_for(gen_cfg):
        return None  # static batches


@register_decoder(
    "blockwise-stream", prepare_cli=prepare_streaming_cli,
    guarantee="blockwise decoding streamed with refills (continuous batching): rows at different lengths verify "
              "their blocks in one call; blockwise's tokens",
)
class BlockwiseStreamGenerator(BlockwiseGenerator):
    """Blockwise decoding with streaming refills: a refill's rows join the running ones (see streaming.py)."""

    name = "blockwise-stream"

    @staticmethod
    def scheduler_for(gen_cfg):
        scheduler = StreamingScheduler.from_config(gen_cfg)
        if scheduler.selection != "min-length":
            raise UsageError(f"--stream-selection {scheduler.selection}: --decoder blockwise-stream expands every "
                             f"active row at every iteration; the selection applies to the cohorts of greedy-stream, "
                             f"var-stream and fixed-stream")
        return scheduler
