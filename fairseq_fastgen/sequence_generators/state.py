"""One object that holds every per-row tensor of a decoding pass.

A *row* is one hypothesis under construction (one per sentence for greedy and
blockwise decoding, up to ``beam`` per sentence for beam searches).  All
per-row fields move together through :meth:`DecodingState.select` and grow
together through :meth:`DecodingState.append`, so no decoder keeps parallel
tensors in sync by hand.
"""

from typing import List, Optional

import torch


class DecodingState:
    def __init__(self, runner, tokens, sentence, max_len, encoder_out, cache, src_len):
        self.runner = runner  # ModelRunner: knows how to reorder encoder outputs and caches
        self.tokens = tokens  # (rows, length) long, column 0 is the bos (= eos) symbol
        self.cum_scores = tokens.new_zeros((tokens.size(0), 0), dtype=torch.float)  # (rows, length - 1)
        self.attn: Optional[torch.Tensor] = None  # (rows, src_len, length - 1) or None
        self.sentence = sentence  # (rows,) long: index of the row's sentence in the pool
        self.max_len = max_len  # (rows,) long: at step >= max_len only eos may be generated
        self.encoder_out = encoder_out  # fairseq encoder output, batch dimension = rows
        self.cache = cache  # fairseq incremental_state dict, batch dimension = rows
        self.src_len = src_len  # padded source length of every row's encoder output

    @property
    def rows(self) -> int:
        return self.tokens.size(0)

    @property
    def length(self) -> int:
        """Tokens generated so far (not counting the leading bos)."""
        return self.tokens.size(1) - 1

    @property
    def scores(self) -> torch.Tensor:
        """Cumulative log-probability of every row; (rows,)."""
        if self.cum_scores.size(1) == 0:
            return self.cum_scores.new_zeros(self.rows)
        return self.cum_scores[:, -1]

    def append(self, new_tokens, new_lprobs, new_attn=None):
        """Extend every row by ``n`` tokens.

        new_tokens: (rows, n) long; new_lprobs: (rows, n) float, the log-probability
        of each new token; new_attn: (rows, src_len, n) or None.
        """
        cumulative = self.scores.unsqueeze(1) + new_lprobs.cumsum(dim=1)  # (rows, n)
        if new_lprobs.size(1) == 1:  # keep stock fairseq's rounding: one addition per step
            cumulative = self.scores.unsqueeze(1) + new_lprobs
        self.tokens = torch.cat([self.tokens, new_tokens], dim=1)
        self.cum_scores = torch.cat([self.cum_scores, cumulative], dim=1)
        if new_attn is not None:
            self.attn = new_attn if self.attn is None else torch.cat([self.attn, new_attn], dim=2)

    def select(self, index: torch.Tensor):
        """Keep (and reorder to) the rows in ``index`` (long, may repeat rows)."""
        self.tokens = self.tokens.index_select(0, index)
        self.cum_scores = self.cum_scores.index_select(0, index)
        if self.attn is not None:
            self.attn = self.attn.index_select(0, index)
        self.sentence = self.sentence.index_select(0, index)
        self.max_len = self.max_len.index_select(0, index)
        self.encoder_out = self.runner.reorder_encoder_out(self.encoder_out, index)
        self.runner.reorder_cache(self.cache, index)

    def replace_tokens(self, tokens, cum_scores, attn=None):
        """Set token history directly (beam searches rebuild rows from candidates)."""
        self.tokens, self.cum_scores = tokens, cum_scores
        if attn is not None:
            self.attn = attn

    @staticmethod
    def concat(states: List["DecodingState"]) -> "DecodingState":
        """Merge states of equal length into one (streaming: a cohort that caught up)."""
        first = states[0]
        if any(s.length != first.length for s in states):
            raise ValueError("only states of equal length can be merged")
        merged = DecodingState(
            first.runner,
            torch.cat([s.tokens for s in states]),
            torch.cat([s.sentence for s in states]),
            torch.cat([s.max_len for s in states]),
            first.runner.concat_encoder_out([s.encoder_out for s in states]),
            first.runner.concat_caches([s.cache for s in states]),
            max(s.src_len for s in states),
        )
        merged.cum_scores = torch.cat([s.cum_scores for s in states])
        if first.attn is not None:
            merged.attn = _cat_padded_attn([s.attn for s in states])
        return merged


def _cat_padded_attn(attns):
    src_len = max(a.size(1) for a in attns)
    padded = [torch.nn.functional.pad(a, (0, 0, src_len - a.size(1), 0)) for a in attns]
    return torch.cat(padded)
