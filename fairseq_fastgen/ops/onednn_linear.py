"""The model's linear layers through oneDNN's prepacked fp32 product, on the CPU (``--onednn-linear``).

torch computes ``nn.Linear`` on the CPU with MKL, which takes a generic code
path on CPUs that are not Intel's, such as AMD's: there its products at
decoding shapes run slower than oneDNN's, which torch also ships
(docs/benchmarks.md, "Products and memory on the CPU").  oneDNN packs
a weight once into its blocked layout; the product then reads it as packed.

Entry point: :func:`onednn_linear` (x, packed weight, bias); its reference is
``torch.nn.functional.linear`` (the tests compare them).  Both compute in
fp32 but sum in different orders, so results differ in the last bits: a
decoder's scores move by about 1e-6 and its tokens can change only where two
candidates are that close.  This is why the option is off by default and
stock fairseq's bitwise guarantees (the shared encoder cache, the lean beam
loop) are stated without it.

:class:`PackedForward` is one layer's product through its packed weight;
:class:`fairseq_fastgen.adapters.linear_forwards.OneDNNLinears` puts one in
place of the ``forward`` of every ``nn.Linear`` of a model while attached.
Packed weights are kept between batches and packed again when the layer's
weight changes (``ops/linear_forward.py``).  Where the product needs a
gradient, or a layer's weight is not fp32, the layer keeps its own forward.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_fastgen.ops.linear_forward import LinearForward

# oneDNN chooses the packed layout for an expected number of rows: a hint of
# 64 rows packs a layout as fast at a few rows as a smaller hint, and faster at
# many rows.
ROWS_HINT = 64
# A oneDNN product has a higher fixed cost per call than MKL's: below this many
# multiply-adds (rows x in x out) MKL's is faster, and the layer keeps torch's
# product.
MIN_MULTIPLY_ADDS = 1 << 20
# oneDNN builds one primitive per product shape (memory and time to build each),
# and beam search meets a new row count whenever a sentence ends: rows are
# padded up to one of this many sizes per power of two.
ROW_SIZES_PER_OCTAVE = 8


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: Tensor) -> Tensor:
    """weight (out, in) fp32 on the CPU -> oneDNN's packed copy."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to one of ROW_SIZES_PER_OCTAVE sizes per power of two (exact below 2 x that)."""
    step = 1 << max(0, rows.bit_length() - 1 - ROW_SIZES_PER_OCTAVE.bit_length() + 1)
    return -(-rows // step) * step


def onednn_linear(x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)`` (or ``weight`` itself,
    contiguous: oneDNN reorders it on the fly): x (..., in) -> (..., out).

    oneDNN builds (and keeps) one primitive per shape, so the rows are padded with
    zeros up to :func:`padded_rows`: decoding meets few distinct shapes.
    """
    rows = x.reshape(-1, x.size(-1))  # (rows, in)
    count, padded = rows.size(0), padded_rows(rows.size(0))
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.size(1))])  # (padded, in)
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None if bias is None else bias.detach(),
                                             "none", [], "")  # (padded, out)
    return out[:count].view(*x.shape[:-1], out.size(-1))


def onednn_serves(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN computes ``F.linear(x, weight, ...)`` under the option: fp32 on the
    CPU, no gradient, and at least MIN_MULTIPLY_ADDS multiply-adds (rows x in x out)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and x.numel() * weight.size(0) >= MIN_MULTIPLY_ADDS)


def attached_to(linear: nn.Linear) -> bool:
    """Whether ``--onednn-linear`` is attached to ``linear`` now."""
    return isinstance(linear.__dict__.get("forward"), PackedForward)


def linear_like(linear: nn.Linear, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` for a weight derived from ``linear``'s (the cluster
    projection's gathered rows, its centroids): through oneDNN on the unpacked weight while
    the option is attached to ``linear`` and the product is one it serves, else torch's.
    A weight used once is not worth packing; unpacked, oneDNN's product still runs faster
    than MKL's at many rows where MKL takes its generic path (docs/benchmarks.md, "Products
    and memory on the CPU")."""
    if attached_to(linear) and x.device.type == "cpu" and onednn_serves(x, weight):
        return onednn_linear(x, weight.detach().contiguous(), bias)
    return F.linear(x, weight, bias)


class PackedForward(LinearForward):
    """Stands in for ``linear.forward``: the product through the packed weight."""

    option = "--onednn-linear"

    def prepare(self, weight: Tensor) -> Tensor:
        return pack_weight(weight)

    def serves(self, x: Tensor, weight: Tensor) -> bool:  # gradients, other dtypes, small products: MKL's
        return onednn_serves(x, weight)

    def product(self, x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
        return onednn_linear(x, packed, bias)
