"""In-place reordering of attention caches during beam search.

Entry points:
  * :func:`reorder_beam_cache` -- the decoder self-attention K/V cache follows
    the beams: row ``r`` becomes old row ``new_order[r]``;
  * :func:`shrink_shared_cache` -- the encoder-decoder cache, stored once per
    sentence, keeps only the sentences still being decoded.

CUDA tensors go to the kernel in ``kernels/cache_reorder.cu`` (through CuPy),
which moves only the rows that change, in place, with no scratch tensor (see
the scheme in the kernel source). Everything else, and CUDA when CuPy is
missing or the cache is not contiguous, goes to the torch references beside
them.
"""

from typing import Optional

import numpy as np
import torch

from fairseq_fastgen.ops import _cupy
from fairseq_fastgen.ops._cupy import Launch

KERNEL_FILE = "cache_reorder"

# (bytes per word, torch dtype of the word view, kernel), widest first.
_WORD_KERNELS = (
    (4, torch.int32, "gather_rows_in_place_u32"),
    (2, torch.int16, "gather_rows_in_place_u16"),
    (1, torch.uint8, "gather_rows_in_place_u8"),
)
_SOURCE_INDEX_BYTES = 4  # the kernel keeps the source row of every destination as int
_MOST_TILE_WORDS = 256  # bigger tiles would leave too few blocks for short rows


def reorder_beam_cache(cache: torch.Tensor, new_order: torch.Tensor) -> torch.Tensor:
    """Sets ``cache[r]`` to the old ``cache[new_order[r]]`` for every row ``r``,
    in place; returns ``cache``.

    cache: (rows, heads, len, head_dim), any dtype.
    new_order: (rows,) long, the beam each row continues.
    """
    _check_rows(cache, new_order, "new_order")
    if new_order.numel() != cache.size(0):
        raise ValueError(f"new_order has {new_order.numel()} entries for {cache.size(0)} cache rows")
    launch = _kernel_launcher(cache)
    if launch is None:
        return reorder_beam_cache_reference(cache, new_order)
    return gather_rows_with_kernel(cache, new_order, launch)


def reorder_beam_cache_reference(cache: torch.Tensor, new_order: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`reorder_beam_cache`."""
    return cache.copy_(cache.index_select(0, new_order))


def shrink_shared_cache(cache: torch.Tensor, keep_sentences: torch.Tensor) -> torch.Tensor:
    """Keeps the sentences ``keep_sentences`` (in that order) of a cache stored
    once per sentence; returns a tensor whose row ``i`` is the old
    ``cache[keep_sentences[i]]``.

    cache: (bsz, heads, src_len, head_dim) or (bsz, 1, ...), any dtype.
    keep_sentences: (kept,) long.

    The cache is consumed: on CUDA the result is the first ``kept`` rows of
    ``cache``, compacted in place (no new allocation); elsewhere it is a new
    tensor. Use only the result afterwards.
    """
    _check_rows(cache, keep_sentences, "keep_sentences")
    if keep_sentences.numel() > cache.size(0):
        raise ValueError(f"keeping {keep_sentences.numel()} of {cache.size(0)} sentences")
    launch = _kernel_launcher(cache)
    if launch is None:
        return shrink_shared_cache_reference(cache, keep_sentences)
    return gather_rows_with_kernel(cache, keep_sentences, launch)[: keep_sentences.numel()]


def shrink_shared_cache_reference(cache: torch.Tensor, keep_sentences: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`shrink_shared_cache` (a new tensor)."""
    return cache.index_select(0, keep_sentences)


def gather_rows_with_kernel(
    data: torch.Tensor,
    source_rows: torch.Tensor,
    launch: Launch,
    tile_words: Optional[int] = None,
    threads_per_block: Optional[int] = None,
) -> torch.Tensor:
    """Sets ``data[r]`` to the old ``data[source_rows[r]]`` for ``r`` in
    ``range(len(source_rows))``, in place, with the CUDA kernel started by
    ``launch`` (the CuPy launcher, or the CPU emulator's in tests); returns
    ``data``. Rows past ``len(source_rows)`` keep their bytes.

    data: (rows, ...) contiguous.
    source_rows: (dest_rows,) long, dest_rows <= rows.

    ``tile_words`` (words of every row per block) and ``threads_per_block``
    override the launch shape, for tests.
    """
    rows, dest_rows = data.size(0), source_rows.numel()
    row_bytes = data[0].numel() * data.element_size() if rows else 0
    if dest_rows == 0 or row_bytes == 0:
        return data
    word_bytes, word_dtype, kernel_name = next(
        word for word in _WORD_KERNELS if row_bytes % word[0] == 0 and data.data_ptr() % word[0] == 0
    )
    row_words = row_bytes // word_bytes
    if tile_words is None:
        staging_budget = _cupy.SHARED_MEMORY_LIMIT_BYTES - dest_rows * _SOURCE_INDEX_BYTES
        tile_words = min(_MOST_TILE_WORDS, row_words, staging_budget // (dest_rows * word_bytes))
        if tile_words < 1:  # too many rows to stage even one word of each
            return _gather_rows_reference(data, source_rows)
    shared_bytes = dest_rows * (_SOURCE_INDEX_BYTES + tile_words * word_bytes)
    threads = threads_per_block or _cupy.threads_for(dest_rows * tile_words)
    launch(
        kernel_name,
        (-(-row_words // tile_words),),
        (threads,),
        shared_bytes,
        data.view(rows, -1).view(word_dtype),
        source_rows.contiguous(),
        np.int64(row_words),
        np.int32(rows),
        np.int32(dest_rows),
        np.int32(tile_words),
    )
    return data


def _gather_rows_reference(data: torch.Tensor, source_rows: torch.Tensor) -> torch.Tensor:
    data[: source_rows.numel()] = data.index_select(0, source_rows)
    return data


def _kernel_launcher(cache: torch.Tensor) -> Optional[Launch]:
    if not cache.is_contiguous():
        return None
    return _cupy.launcher_for(cache, KERNEL_FILE)


def _check_rows(cache: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    if cache.dim() < 1:
        raise ValueError("the cache needs a row dimension")
    if rows.dim() != 1 or rows.dtype != torch.long:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {tuple(rows.shape)} {rows.dtype}")
    if rows.device != cache.device:
        raise ValueError(f"{name} is on {rows.device}, the cache on {cache.device}")
