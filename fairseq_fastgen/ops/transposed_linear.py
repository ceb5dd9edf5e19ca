"""The model's linear layers as products by a transposed copy of each weight, on the CPU (``--transposed-linear``).

``nn.Linear`` keeps its weight (out, in) and ``F.linear`` multiplies the rows by it
transposed.  On the Intel Xeon of docs/benchmarks.md, MKL multiplies a few rows by a
weight stored (in, out) much faster than by the same weight stored (out, in): at 4-8
rows the Multi30k model's vocabulary projection (8008 x 256) takes about half the time,
at 16 rows 0.8x, its feed-forward products 0.6-0.9x; at 1-2 rows the two cost the same
and from 64 rows nearly so (``benchmarks/onednn_products.py --transposed``).  Decoding
meets 4-16 rows at the steps of greedy decoding at batch 8-16, of blockwise verification
(block size + 1 rows a sentence) and of a stream's running batch.  Products of fewer than
MIN_ROWS rows keep torch's own (the stand-in's call would cost more than it saves), so
greedy decoding at batch 1 keeps fairseq's bits.

Entry point: :func:`transposed_linear` (x, weight transposed, bias); its reference is
``torch.nn.functional.linear`` (the tests compare them).  Both sum the same fp32 products,
but below about 12 rows (and for 1024-wide inputs at every row count) MKL sums them in
another order: scores move in the last bits and a token can change only where two
candidates are that close, which is why the option is off by default.  The copy adds
the linear layers' weights once more to memory (29 MB for the Multi30k decoder).

:class:`TransposedForward` is one layer's product through its transposed copy;
:class:`fairseq_fastgen.adapters.linear_forwards.TransposedLinears` puts one in place of
the ``forward`` of every ``nn.Linear`` of a model while attached.
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq_fastgen.ops.derived_weight import DerivedWeightForward

MIN_ROWS = 4


def transpose_weight(weight: Tensor) -> Tensor:
    """weight (out, in) -> its transposed copy (in, out), contiguous."""
    return weight.detach().t().contiguous()


def transposed_linear(x: Tensor, transposed: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``transposed = transpose_weight(weight)``: x (..., in) -> (..., out)."""
    rows = x.reshape(-1, x.size(-1))  # (rows, in)
    out = torch.mm(rows, transposed) if bias is None else torch.addmm(bias.detach(), rows, transposed)  # (rows, out)
    return out.view(*x.shape[:-1], transposed.size(1))


class TransposedForward(DerivedWeightForward):
    """Stands in for ``linear.forward``: the product by the transposed weight (``copy``)."""

    option = "--transposed-linear"
    derive = staticmethod(transpose_weight)
    product = staticmethod(transposed_linear)

    def serves(self, x: Tensor, weight: Tensor) -> bool:
        return x.numel() >= MIN_ROWS * x.size(-1) and super().serves(x, weight)
