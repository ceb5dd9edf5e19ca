"""The most probable token of every row: what ``topk(1, dim=-1)`` returns, sooner on the CPU for many rows.

torch's CPU ``topk``, ``max`` and ``argmax`` along a row walk it one element at a time, while ``amax`` is
vectorized.  ``top_token`` takes the maxima of blocks of about a hundred scores with ``amax``, the first block
holding the row's maximum, and the first position in that block holding it: the maximum and the first index of it,
which is what ``topk(1)`` returns on ties.  Rows holding a NaN, CUDA tensors and few rows go to ``topk`` itself.
"""

import functools
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 128  # scores per block where no divisor of the vocabulary suits: 64-160 cost about the same, less more
MIN_ROWS = 16  # below this topk is as fast


@functools.lru_cache(maxsize=None)
def block_size(vocab: int) -> int:
    """A block of 64-160 scores that divides ``vocab`` (no padded copy of the scores), else ``BLOCK``."""
    return next((size for size in range(160, 63, -1) if vocab % size == 0), BLOCK)


def top_token(scores: Tensor) -> Tuple[Tensor, Tensor]:
    """scores (rows, vocab) float -> (values (rows, 1), indices (rows, 1) long), as ``scores.topk(1, dim=-1)``."""
    rows, vocab = scores.shape
    if rows < MIN_ROWS or scores.is_cuda or not scores.is_contiguous():
        return tuple(scores.topk(1, dim=-1))
    size = block_size(vocab)
    padded = F.pad(scores, (0, -vocab % size), value=-torch.inf) if vocab % size else scores
    blocks = padded.view(rows, -1, size)  # (rows, blocks, size)
    block_max = blocks.amax(dim=2)  # (rows, blocks)
    best = block_max.amax(dim=1, keepdim=True)  # (rows, 1)
    if bool(best.isnan().any()):  # topk ranks NaN first; the comparisons below never find it
        return tuple(scores.topk(1, dim=-1))
    block = block_max.eq(best).byte().argmax(dim=1)  # (rows,) the first block holding the maximum
    within = blocks[torch.arange(rows, device=scores.device), block]  # (rows, size)
    offset = within.eq(best).byte().argmax(dim=1)  # (rows,) its first position there
    return best, (block * size + offset).unsqueeze(1)
