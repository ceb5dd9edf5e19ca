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

The rows live in a :class:`DecodingState` with per-row lengths (rows accept
different numbers of tokens); its ``extra`` holds each row's next block:
``proposals`` (rows, block), the first proposal's lprob ``first_lprob``
(rows,) and attention ``first_attn`` (rows, src_len) or None.

Acceptance is exact by default: a proposal is accepted iff it is greedy's
choice (argmax of p_1 after the step processors), so the output is the greedy
output of head 1.  ``--blockwise-top-k``, ``--blockwise-epsilon`` and
``--blockwise-min-block`` accept more, approximately (see options.py).
"""

import torch
from torch import Tensor

from fairseq_fastgen.ops.top_token import top_token
from fairseq_fastgen.sequence_generators.blockwise.one_row import OneRowPath
from fairseq_fastgen.sequence_generators.blockwise.options import exact_acceptance
from fairseq_fastgen.sequence_generators.processors import StepRows
from fairseq_fastgen.sequence_generators.state import DecodingState
from fairseq_fastgen.sequence_generators.streaming import (
    PADDING_SENTENCE,
    drain_waiting_rows,
    finished_rows_wait,
    join_any_lengths,
)

SOURCE_EXTRAS = frozenset({"first_attn"})  # the state's extras shaped (rows, src_len)


# ---- the search policy -----------------------------------------------------------------------
class BlockwisePolicy(OneRowPath):
    """Predict / verify / accept; one model invocation per iteration after the first step."""

    def __init__(self, block_size, acceptance, min_block, pad, int8_proposals=False, proposal_tokens=None):
        self.block_size = block_size
        self.acceptance = acceptance
        self.min_block = min_block
        self.pad = pad
        self.int8_proposals = int8_proposals  # heads 2..k propose from the runner's int8 copies of their weights
        self.proposal_tokens = proposal_tokens  # (N,) the only tokens they propose (None: every token)
        # a lone row with exact acceptance takes advance_one_row: the same computation with Python
        # integers in place of the small tensors of per-row bookkeeping (batch 1, a batch's last row)
        self.one_row_path = exact_acceptance(acceptance, min_block)

    # streaming: a refill's rows join the running ones, whatever their lengths, their bos run by ``start`` with
    # the group of sources encoded ahead (``EncodedAhead``): their first call beside the running rows verifies a block
    joins_lengths = True
    # blockwise-stream: a finished row stays, as a padding row whose blocks are ignored, until a refill's row
    # takes its place (``finished_rows_wait``)
    streaming = False

    # streaming: every state's rows in one (the proposed blocks' first attention, a source-shaped extra, padded
    # and cut with the sources)
    join = staticmethod(join_any_lengths)

    @staticmethod
    def drain(state, ctx):
        """No source waits for a finished row's place: the finished rows go (a row costs a block of positions)."""
        return drain_waiting_rows(state)

    def start(self, state: DecodingState, ctx) -> DecodingState:
        """Run the bos position; its heads propose the first block."""
        bos = state.tokens  # (rows, 1)
        state.source_extras = SOURCE_EXTRAS
        state.use_row_lengths(int(state.max_len.max()) + 1, self.pad)  # at most max_len tokens and eos
        positions = bos.new_zeros((state.rows, 1))
        features, attn, all_heads, lprobs = self.score_block(state, bos, positions, ctx)  # a block of one position
        base, first_lprobs = features[:, 0], lprobs[:, 0]  # (rows, dim), (rows, vocab)
        heads = None if all_heads is None else all_heads[:, 0]  # (rows, block, dim)
        ctx.process(first_lprobs, StepRows(state.lengths, state.max_len, state.sentence, state.tokens))
        self.propose(state, ctx, first_lprobs, None if attn is None else attn[:, 0],
                     self.later_scores(base, heads, ctx))
        return state

    def advance(self, state: DecodingState, ctx):
        # a lone row that is not waiting for a refill (streaming)
        if state.rows == 1 and self.one_row_path and not ctx.reads_tokens \
                and int(state.sentence[0]) != PADDING_SENTENCE:
            self.advance_one_row(state, ctx)
            return
        lengths = state.lengths  # (rows,) accepted tokens
        rows = torch.arange(state.rows, device=state.tokens.device)
        remaining = int((state.max_len + 1 - lengths).max())  # tokens a row may still take, eos included
        block = state.extra["proposals"][:, : min(self.block_size, remaining)]  # (rows, n)
        n = block.size(1)
        offsets = torch.arange(n, device=block.device)
        positions = (lengths.unsqueeze(1) + 1 + offsets).clamp(max=ctx.runner.max_target_positions - 1)
        ctx.counters.add("row_iterations", state.rows)
        features, attn, all_heads, lprobs = self.score_block(state, block, positions, ctx)
        steps = (lengths.unsqueeze(1) + 1 + offsets).view(-1)  # (rows * n,)
        flat = lprobs.view(-1, lprobs.size(-1))
        row_of = rows.unsqueeze(1).expand(-1, n).reshape(-1)  # (rows * n,)
        block_rows = StepRows(steps, state.max_len[row_of])
        if ctx.reads_tokens:  # each row's tokens with its block: the history of each block position
            history = torch.cat([state.tokens, block.new_full((state.rows, n), self.pad)], dim=1)
            history[rows.unsqueeze(1), 1 + lengths.unsqueeze(1) + offsets] = block
            block_rows.sentence, block_rows.tokens = state.sentence[row_of], history[row_of]
        ctx.process(flat, block_rows)
        best = top_token(flat)[1].view(block.shape)  # (rows, n): greedy's choice after each block token
        accepted = self.accepted_prefix(block, lprobs, best, ctx.eos)  # (rows, n)
        kept = accepted  # (rows, n) the positions the cache keeps
        waiting = state.sentence.eq(PADDING_SENTENCE)  # (rows,) finished rows waiting for a refill's row
        if bool(waiting.any()):  # they accept no token; the cache keeps their first position
            kept = torch.where(waiting.unsqueeze(1), offsets.eq(0).unsqueeze(0), accepted)
            accepted = accepted & ~waiting.unsqueeze(1)
        count = kept.sum(dim=1)  # (rows,) >= 1

        token_lprobs = torch.cat(
            [state.extra["first_lprob"].unsqueeze(1), lprobs[:, :-1].gather(2, block[:, 1:].unsqueeze(2)).squeeze(2)],
            dim=1,
        )  # (rows, n)
        token_attn = None  # (rows, src_len, n)
        if attn is not None:
            token_attn = torch.cat([state.extra["first_attn"].unsqueeze(1), attn[:, :-1]], dim=1).transpose(1, 2)
        state.append(block, token_lprobs, token_attn, accepted)
        state.runner.keep_accepted(state.cache, kept)

        last = count - 1  # the last accepted position proposes the next block
        finished = block[rows, last].eq(ctx.eos) & ~waiting
        for row in finished.nonzero().squeeze(1).tolist():
            ctx.finish(int(state.sentence[row]), [ctx.hypothesis(state, row)])
        alive = finished_rows_wait(state, finished, self.streaming)  # (rows,) the rows that go on
        if state.rows == 0:
            return
        last = last[alive]
        first_lprobs = lprobs[alive, last]  # (rows, vocab), already processed
        first_attn = None if attn is None else attn[alive, last]
        heads = None if all_heads is None else all_heads[alive, last]  # (rows, block, dim)
        self.propose(state, ctx, first_lprobs, first_attn, self.later_scores(features[alive, last], heads, ctx))


    def score_block(self, state, block, positions, ctx):
        """One decoder pass over each row's ``block`` (rows, n) at ``positions`` (rows, n), and head 1's
        verification scores: p_1 after block token j scores block token j + 1. Returns the decoder
        features (rows, n, dim), attention (rows, n, src_len) or None, every head (rows, n, block, dim)
        where computed in full precision (None with an identity head 1: the k-head layer then runs
        only where proposals are read) and head 1's lprobs (rows, n, vocab), not yet processed."""
        if ctx.runner.identity_first_head:  # head 1 is the base output: scored with the pass, by the runner
            features, attn, lprobs = state.runner.step_block_scored(block, positions, state.encoder_out, state.cache)
            ctx.counters.add("model_calls")
            return features, attn, None, lprobs
        features, attn = self.run_block(state, block, positions, ctx)
        all_heads = ctx.runner.heads(features, self.block_size)
        return features, attn, all_heads, self.log_probs(all_heads[:, :, 0], ctx)

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
        if not self.int8_proposals:
            heads = ctx.runner.heads(base, self.block_size) if heads is None else heads
            return self.log_probs(heads[:, 1:], ctx, normalize=False)
        proposer = ctx.runner.int8_proposals(self.proposal_tokens)
        # (rows, k - 1, dim)
        later = ctx.runner.int8_later_heads(base, proposer) if heads is None else heads[:, 1:]
        return self.log_probs(later[:, : self.block_size - 1], ctx, project=proposer.logits, normalize=False)

    def propose(self, state: DecodingState, ctx, first_lprobs, first_attn, later_scores):
        """Set the next block: greedy's token from ``first_lprobs`` (rows, vocab),
        processed) then one token per later head from ``later_scores`` (rows,
        block - 1, vocab), each processed with the proposals before it as context."""
        first_lprob, first = top_token(first_lprobs)  # (rows, 1) each
        state.extra["first_lprob"] = first_lprob.squeeze(1)  # (rows,)
        state.extra["first_attn"] = first_attn  # (rows, src_len) or None
        if self.block_size == 1:
            state.extra["proposals"] = first
            return
        if ctx.reads_tokens:
            state.extra["proposals"] = self.propose_in_turn(state, ctx, first, later_scores)
            return
        # no processor reads earlier tokens: every later head is processed at once, at its own step
        later = self.block_size - 1
        steps = (state.lengths.unsqueeze(1) + 1 + torch.arange(later, device=first.device)).view(-1)  # (rows * later,)
        flat = later_scores.reshape(-1, later_scores.size(-1))  # (rows * later, vocab)
        ctx.process(flat, StepRows(steps, state.max_len.repeat_interleave(later)))  # each row's limit, later times
        best = top_token(flat)[1].view(state.rows, later)  # (rows, later), ties as propose_in_turn
        state.extra["proposals"] = torch.cat([first, best], dim=1)  # (rows, block)

    def propose_in_turn(self, state, ctx, first, later_scores):
        """Proposals (rows, block), each later head processed with the proposals before it as history."""
        rows = torch.arange(state.rows, device=first.device)
        lengths = state.lengths  # (rows,)
        history = torch.cat([state.tokens, state.tokens.new_full((state.rows, self.block_size), self.pad)], dim=1)
        history[rows, 1 + lengths] = first.squeeze(1)
        for head in range(1, self.block_size):
            scores = later_scores[:, head - 1]
            ctx.process(scores, StepRows(lengths + head, state.max_len, state.sentence, history))
            history[rows, 1 + lengths + head] = top_token(scores)[1].squeeze(1)
        columns = 1 + lengths.unsqueeze(1) + torch.arange(self.block_size, device=rows.device)
        return history[rows.unsqueeze(1), columns]  # (rows, block)

    # ---- the model, through the runner ----------------------------------------------------------
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

