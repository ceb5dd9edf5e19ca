"""The vocabulary projection's logits written in rows that start on a cache line.

A fairseq dictionary given as a file from a 32k sentencepiece vocabulary holds 32,003 symbols, so the (rows, 32003) float32
logits of a step put every row but the first at an address that is not a multiple of 32 bytes.  torch's product on
the CPU (MKL's ``sgemm``) writes such a result well below its rate: on an AMD EPYC (Zen 3), one thread, 64 rows by a
512 x 32,003 weight ran at 46 GFLOP/s and 320 rows at 59, against 58 and 82 into aligned rows
(``benchmarks/aligned_logits.py``; docs/benchmarks.md, "Logits in aligned rows").

:func:`aligned_rows_linear` computes the same product (the same rows, columns and inner dimension, so the same sums
in the same order) into a buffer whose rows are padded to ``ROW_FLOATS`` floats and returns the (rows, out) view of
it: only the result's row stride differs, not its values (``tests/ops/test_aligned_rows.py`` checks the bits against
``F.linear`` at many row counts).  The log-softmax that follows reads the view as it would the contiguous logits.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

# a result whose rows are a multiple of this many floats apart (32 bytes) is written at the product's full rate;
# fairseq's dictionaries are padded to a multiple of 8 symbols unless given as a file (--srcdict, --tgtdict)
ALIGNED_FLOATS = 8
# the padded buffer's rows are a multiple of this many floats long (64 bytes, a cache line)
ROW_FLOATS = 16


def padded_width(columns: int) -> int:
    """``columns`` rounded up to a multiple of ROW_FLOATS."""
    return -(-columns // ROW_FLOATS) * ROW_FLOATS


def folds(x: Tensor, weight: Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` (no bias) computes one product of x's rows viewed as a (rows, in) matrix, as
    torch's ``matmul`` decides it: a matrix, a weight that requires a gradient (a model's parameter), or leading
    dimensions that view as one without a copy.  Otherwise (the (rows, 1, in) transpose of a (1, rows, in) step's
    features by a weight that requires none) it multiplies row by row, in other sums."""
    if x.dim() == 2 or weight.requires_grad:
        return True
    sizes, strides = x.shape, x.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(x.dim() - 2))


def aligns(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`aligned_rows_linear` computes ``F.linear(x, weight)`` through a padded buffer: float32 on the
    CPU, no gradient, more than one row, a product of the rows as one matrix (:func:`folds`), and an output width
    that is not a multiple of ALIGNED_FLOATS."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and weight.size(0) % ALIGNED_FLOATS != 0 and x.numel() > x.size(-1) and folds(x, weight))


def aligned_rows_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` (no bias): x (..., in), weight (out, in) -> (..., out), the same bits, each row of the
    result starting ``padded_width(out)`` floats after the last where :func:`aligns` holds (a view of a padded
    buffer, not contiguous), else ``F.linear``'s own result."""
    if not aligns(x, weight):
        return F.linear(x, weight)
    rows = x.reshape(-1, x.size(-1))  # (rows, in)
    columns = weight.size(0)
    logits = rows.new_empty(rows.size(0), padded_width(columns))[:, :columns]  # (rows, out), rows 64-byte aligned
    torch.mm(rows, weight.t(), out=logits)
    return logits.view(*x.shape[:-1], columns)
