"""Blockwise decoding's batch-1 path: ``advance`` for a lone row with exact acceptance.

The policy (policy.py) takes it for a single row (batch 1, a batch's last row) when acceptance is exact,
``--blockwise-min-block`` is 1 and no step processor reads the history: the same products and the same
float operations on the scores as the batched ``advance`` (so bitwise the same hypotheses), with the
acceptance, the row's steps and its length limits in Python integers in place of small tensors.
"""

import torch

from fairseq_fastgen.ops.top_token import top_token
from fairseq_fastgen.sequence_generators.processors import StepRows
from fairseq_fastgen.sequence_generators.state import DecodingState


class OneRowPath:
    """``BlockwisePolicy``'s lone-row methods; they read the policy's ``block_size``,
    ``score_block`` and ``later_scores``."""

    def advance_one_row(self, state: DecodingState, ctx):
        """``advance`` for a single row, exact acceptance, no processor reading the history:
        the same products and the same float operations on the scores (so bitwise the same
        hypotheses), with the acceptance, the row's steps and its length limits in Python."""
        length, max_len = int(state.row_lengths[0]), int(state.max_len[0])
        n = min(self.block_size, max_len + 1 - length)  # tokens it may still take, eos included
        block = state.extra["proposals"][:, :n]  # (1, n)
        positions = torch.arange(length + 1, length + 1 + n, device=block.device)
        positions = positions.clamp_(max=ctx.runner.max_target_positions - 1).unsqueeze(0)  # (1, n)
        ctx.counters.add("row_iterations", 1)
        features, attn, all_heads, lprobs = self.score_block(state, block, positions, ctx)
        ctx.process(lprobs[0], StepRows(range(length + 1, length + 1 + n), max_len))  # steps in Python
        top_lprobs, top = top_token(lprobs[0])  # (n, 1) each: greedy's choice after each block token
        proposed = block[0].tolist()
        count = self.accepted_count(proposed, top.view(-1).tolist(), ctx.eos)

        token_lprobs = [state.extra["first_lprob"].item()]  # the accepted tokens' lprobs
        if count > 1:
            verified = lprobs[0, torch.arange(count - 1, device=block.device), block[0, 1:count]]  # (count - 1,)
            token_lprobs += verified.tolist()
        token_attn = None  # (count, src_len)
        if attn is not None:
            token_attn = torch.cat([state.extra["first_attn"], attn[0, : count - 1]])
        state.append_lone_row(length, block[0, :count], token_lprobs, token_attn)
        if count < n:  # drop the rejected positions from the self-attention cache
            state.runner.drop_last_positions(state.cache, n - count)

        last = count - 1  # the last accepted position proposes the next block
        if proposed[last] == ctx.eos:
            ctx.finish(int(state.sentence[0]), [ctx.hypothesis(state, 0)])
            state.select(block.new_zeros(0))
            return
        heads = None if all_heads is None else all_heads[:, last]  # (1, block, dim)
        later = self.later_scores(features[:, last], heads, ctx)  # (1, block - 1, vocab) or None
        first = top[last: last + 1]  # (1, 1): greedy's next token, from the processed lprobs at ``last``
        state.extra["first_lprob"] = top_lprobs[last]  # (1,)
        state.extra["first_attn"] = None if attn is None else attn[:, last]  # (1, src_len)
        if later is None:  # a block of 1
            state.extra["proposals"] = first
            return
        first_later = length + count + 1  # the step of head 2's proposal
        ctx.process(later[0], StepRows(range(first_later, first_later + later.size(1)), max_len))
        state.extra["proposals"] = torch.cat([first, top_token(later[0])[1].view(1, -1)], dim=1)

    @staticmethod
    def accepted_count(proposed, best, eos) -> int:
        """``accepted_prefix`` of one row with exact acceptance, in Python: how many tokens of the
        block ``proposed`` (list) to accept, given greedy's choice ``best`` (list) after each."""
        count = 1  # the first is greedy's own choice; then the longest verified prefix, nothing after an eos
        while count < len(proposed) and proposed[count - 1] != eos and proposed[count] == best[count - 1]:
            count += 1
        return count
