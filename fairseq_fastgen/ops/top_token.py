"""The most probable token of every row: what ``topk(1, dim=-1)`` returns, sooner on the CPU.

torch's CPU ``topk``, ``max`` and ``argmax`` along a row walk it one element at a time, while ``amax`` is
vectorized; ``topk`` walks slowest (a 32k-token row: ``topk`` ~48 us, ``max`` ~16 us on one core).  One or two
rows go to ``max``, which returns the first index of the maximum and ranks a NaN first, as ``topk(1)`` does.
From three rows on ``top_token`` takes the maxima of blocks of about a hundred scores with ``amax``, the first block
holding the row's maximum, and the first position in that block holding it: the maximum and the first index of it,
which is what ``topk(1)`` returns on ties.  Where no block size divides the vocabulary the scores past the last
whole block are a short block of their own (no padded copy of the scores).  Rows holding a NaN and CUDA tensors
go to ``topk`` itself.
"""

import functools
from typing import Tuple

import torch
from torch import Tensor

BLOCK = 128  # scores per block where no divisor of the vocabulary suits: 64-160 cost about the same, less more
MAX_ROWS = 2  # up to this many rows ``max`` is the quickest (32k tokens: 16 us a row; the blocks 33 us at one row)
MIN_ROWS = MAX_ROWS + 1  # from here the blocks are quickest (32k tokens, 4 rows: 47 us against max's 52, topk's 152)


@functools.lru_cache(maxsize=None)
def block_size(vocab: int) -> int:
    """A block of 64-160 scores that divides ``vocab`` (no short last block), else ``BLOCK``."""
    return next((size for size in range(160, 63, -1) if vocab % size == 0), BLOCK)


def top_token(scores: Tensor) -> Tuple[Tensor, Tensor]:
    """scores (rows, vocab) float -> (values (rows, 1), indices (rows, 1) long), as ``scores.topk(1, dim=-1)``."""
    rows, vocab = scores.shape
    if scores.is_cuda:
        return tuple(scores.topk(1, dim=-1))
    if rows <= MAX_ROWS or not scores.is_contiguous():
        return tuple(scores.max(dim=-1, keepdim=True))
    size = block_size(vocab)
    whole = vocab - vocab % size  # scores in whole blocks; the rest (fewer than `size`) is one block of its own
    blocks = scores[:, :whole].view(rows, whole // size, size)  # (rows, blocks, size), a view
    block_max = blocks.amax(dim=2)  # (rows, blocks)
    if whole < vocab:
        block_max = torch.cat([block_max, scores[:, whole:].amax(dim=1, keepdim=True)], dim=1)  # (rows, blocks + 1)
    best = block_max.amax(dim=1, keepdim=True)  # (rows, 1)
    if bool(best.isnan().any()):  # topk ranks NaN first; the comparisons below never find it
        return tuple(scores.topk(1, dim=-1))
    block = block_max.eq(best).byte().argmax(dim=1, keepdim=True)  # (rows, 1) the first block holding the maximum
    # (rows, size) its positions; in the last, short block the ones past the vocabulary repeat its last score,
    # after the first position holding the maximum
    positions = (block * size + torch.arange(size, device=scores.device)).clamp_(max=vocab - 1)
    offset = scores.gather(1, positions).eq(best).byte().argmax(dim=1, keepdim=True)  # (rows, 1) its first position
    return best, block * size + offset
