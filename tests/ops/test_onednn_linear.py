"""``--onednn-linear``: the model's linear layers through oneDNN's packed fp32 product.

The padded row counts, the stand-in forward's small products.  The op against its
reference (``F.linear``) within fp32 rounding, weight updates, gradients and
attaching: tests/ops/test_linear_stand_ins.py; decoding with the option:
tests/fastseq/test_onednn_decoding.py.
"""

import pytest
import torch
import torch.nn.functional as F

from fairseq_fastgen.ops.onednn_linear import (
    MIN_MULTIPLY_ADDS, ROW_SIZES_PER_OCTAVE, PackedForward, onednn_available, onednn_linear, pack_weight, padded_rows,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")

EPS = torch.finfo(torch.float32).eps


def rounding_bound(x, weight, bias):
    """Each output of two fp32 sums of the same K products differs by at most about
    2 K eps times the sum of the products' magnitudes (plus the bias's)."""
    magnitude = F.linear(x.abs().double(), weight.abs().double(), None if bias is None else bias.abs().double())
    return 2 * x.size(-1) * EPS * magnitude + 1e-30


def test_padded_rows_bound_the_shapes_and_the_padding():
    sizes = [padded_rows(rows) for rows in range(1, 1025)]
    assert sizes[:2 * ROW_SIZES_PER_OCTAVE - 1] == list(range(1, 2 * ROW_SIZES_PER_OCTAVE))  # exact when small
    assert all(rows <= size <= rows * (1 + 1 / ROW_SIZES_PER_OCTAVE) for rows, size in enumerate(sizes, 1))
    assert sizes == sorted(sizes)
    for octave in range(4, 10):  # sizes in [2^octave, 2^(octave + 1))
        assert len({size for size in sizes if 1 << octave <= size < 2 << octave}) == ROW_SIZES_PER_OCTAVE


def layer(out_features, in_features, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features).requires_grad_(False)


def test_packed_forward_uses_onednn_only_for_products_worth_it():
    linear = layer(256, 256)
    forward = PackedForward(linear)
    small = torch.randn(4, 256)  # 4 x 256 x 256 multiply-adds: below MIN_MULTIPLY_ADDS
    assert small.numel() * 256 < MIN_MULTIPLY_ADDS
    assert torch.equal(forward(small), F.linear(small, linear.weight, linear.bias))  # torch's own product, bitwise
    assert forward.packed is None  # nothing packed yet
    large = torch.randn(64, 256)
    assert large.numel() * 256 >= MIN_MULTIPLY_ADDS
    assert torch.equal(forward(large), onednn_linear(large, pack_weight(linear.weight), linear.bias))
    assert forward.packed is not None
