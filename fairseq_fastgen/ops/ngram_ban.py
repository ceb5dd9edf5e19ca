"""Repeated n-gram banning (fairseq's ``--no-repeat-ngram-size``).

Entry point: :func:`ban_repeated_ngrams`. CUDA tensors go to the kernel in
``kernels/ngram_ban.cu`` (through CuPy); everything else, and CUDA when CuPy
is missing, to the vectorized torch reference beside it.

Unlike stock fairseq's CPU fallback (which compares the padding too, and so
bans nothing), only the generated part of the token buffer,
``tokens[:, :step + 1]``, is looked at; the padding after it is ignored.
"""

from typing import Optional

import numpy as np
import torch

from fairseq_fastgen.ops import _cupy
from fairseq_fastgen.ops._cupy import Launch

KERNEL_FILE = "ngram_ban"

# The kernel writes the bit pattern of -inf through an unsigned integer view
# of lprobs of the same width; the torch dtypes of those views:
_KERNELS = {
    torch.float32: ("ban_repeated_ngrams_f32", torch.int32),
    torch.float64: ("ban_repeated_ngrams_f64", torch.int64),
    torch.float16: ("ban_repeated_ngrams_f16", torch.int16),
    torch.bfloat16: ("ban_repeated_ngrams_bf16", torch.int16),
}

_SHARED_TOKEN_BYTES = 4  # the kernel keeps the generated tokens as int


def ban_repeated_ngrams(tokens: torch.Tensor, lprobs: torch.Tensor, step: int, n: int) -> torch.Tensor:
    """Sets ``lprobs[row, t] = -inf`` for every token ``t`` that would repeat an
    n-gram of the row; returns ``lprobs`` (modified in place).

    tokens: (rows, buffer_len) long, the generator's token buffer; only
        ``tokens[:, :step + 1]`` (the generated tokens) is read.
    lprobs: (rows, vocab) floating point.
    step: index of the last generated token.
    n: the n-gram size, >= 1.

    For each row and each start ``s`` in ``0 .. step + 1 - n``: if
    ``tokens[row, s : s + n - 1]`` equals the last ``n - 1`` generated tokens,
    then ``tokens[row, s + n - 1]`` is banned. Nothing is banned while fewer
    than ``n`` tokens are generated; for ``n == 1`` every generated token is.
    """
    _check_arguments(tokens, lprobs, step, n)
    launch = _cupy.launcher_for(lprobs, KERNEL_FILE)
    if launch is None:
        return ban_repeated_ngrams_reference(tokens, lprobs, step, n)
    return ban_repeated_ngrams_with_kernel(tokens, lprobs, step, n, launch)


def ban_repeated_ngrams_reference(
    tokens: torch.Tensor, lprobs: torch.Tensor, step: int, n: int
) -> torch.Tensor:
    """Vectorized torch implementation of :func:`ban_repeated_ngrams`."""
    generated_len = step + 1
    if generated_len < n:
        return lprobs
    generated = tokens[:, :generated_len]  # (rows, generated_len)
    ngrams = generated.unfold(1, n, 1)  # (rows, starts, n)
    suffix = generated[:, generated_len - (n - 1):]  # (rows, n - 1)
    matches = (ngrams[:, :, :-1] == suffix.unsqueeze(1)).all(dim=2)  # (rows, starts)
    row_of_start = torch.arange(tokens.size(0), device=tokens.device).unsqueeze(1).expand_as(matches)
    banned_tokens = ngrams[:, :, -1]  # (rows, starts)
    lprobs[row_of_start[matches], banned_tokens[matches]] = float("-inf")
    return lprobs


def ban_repeated_ngrams_with_kernel(
    tokens: torch.Tensor,
    lprobs: torch.Tensor,
    step: int,
    n: int,
    launch: Launch,
    threads_per_block: Optional[int] = None,
) -> torch.Tensor:
    """:func:`ban_repeated_ngrams` with the CUDA kernel, started by ``launch``
    (the CuPy launcher, or the CPU emulator's in tests).

    Rows whose generated part does not fit the kernel's shared memory go to
    the reference instead.
    """
    rows, vocab_size = lprobs.shape
    generated_len = step + 1
    start_count = generated_len - n + 1
    if rows == 0 or start_count <= 0:
        return lprobs
    shared_bytes = generated_len * _SHARED_TOKEN_BYTES
    if shared_bytes > _cupy.SHARED_MEMORY_LIMIT_BYTES:
        return ban_repeated_ngrams_reference(tokens, lprobs, step, n)
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    target = lprobs if lprobs.stride(1) == 1 else lprobs.contiguous()
    kernel_name, bits_dtype = _KERNELS[lprobs.dtype]
    threads = threads_per_block or _cupy.threads_for(generated_len)
    launch(
        kernel_name,
        (rows,),
        (threads,),
        shared_bytes,
        tokens,
        target.view(bits_dtype),
        np.int64(tokens.stride(0)),
        np.int64(target.stride(0)),
        np.int32(vocab_size),
        np.int32(step),
        np.int32(n),
    )
    if target is not lprobs:
        lprobs.copy_(target)
    return lprobs


def _check_arguments(tokens: torch.Tensor, lprobs: torch.Tensor, step: int, n: int) -> None:
    if tokens.dim() != 2 or lprobs.dim() != 2 or tokens.size(0) != lprobs.size(0):
        raise ValueError(
            f"expected tokens (rows, buffer_len) and lprobs (rows, vocab), got {tuple(tokens.shape)} "
            f"and {tuple(lprobs.shape)}"
        )
    if tokens.device != lprobs.device:
        raise ValueError(f"tokens are on {tokens.device}, lprobs on {lprobs.device}")
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64, got {tokens.dtype}")
    if lprobs.dtype not in _KERNELS:
        raise ValueError(f"lprobs must be float32, float64, float16 or bfloat16, got {lprobs.dtype}")
    if not 0 <= step < tokens.size(1):
        raise ValueError(f"step {step} outside the token buffer of length {tokens.size(1)}")
    if n < 1:
        raise ValueError(f"n-gram size must be at least 1, got {n}")
