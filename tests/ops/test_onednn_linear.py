"""``--onednn-linear``: the model's linear layers through oneDNN's packed fp32 product.

The op against its reference (``F.linear``) within fp32 rounding, the stand-in
forward (small products, gradients, weight updates), attaching and detaching on a
model.  Decoding with the option: tests/fastseq/test_onednn_decoding.py.
"""

import pytest
import torch
import torch.nn.functional as F

from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears
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


@pytest.mark.parametrize("rows", [1, 4, 37, 320])  # 37: padded to 40 rows
@pytest.mark.parametrize("out_features,in_features", [(8008, 256), (1024, 256), (256, 1024)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_linear_equals_the_reference_within_rounding(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    # a transposed (1, rows, in) view, as fairseq hands the projection its features
    x = torch.randn(rows, 1, in_features, generator=generator).transpose(0, 1)
    got = onednn_linear(x, pack_weight(weight), bias)
    expected = F.linear(x, weight, bias)
    assert got.shape == expected.shape == (1, rows, out_features)
    assert ((got.double() - expected.double()).abs() <= rounding_bound(x, weight, bias)).all()


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


def test_packed_forward_packs_again_after_a_weight_update():
    linear = layer(1024, 256)
    forward = PackedForward(linear)
    x = torch.randn(16, 256)
    before = forward(x)
    linear.weight.mul_(2)  # in place: the tensor's version changes
    after = forward(x)
    assert torch.allclose(after, 2 * before - linear.bias, atol=1e-4)
    linear.weight = torch.nn.Parameter(torch.zeros(1024, 256), requires_grad=False)  # a new tensor
    assert torch.equal(forward(x), linear.bias.expand(16, -1))


def test_packed_forward_keeps_gradients_and_other_dtypes_on_torchs_product():
    linear = torch.nn.Linear(256, 1024)  # a weight that needs a gradient
    forward = PackedForward(linear)
    x = torch.randn(64, 256)
    y = forward(x)
    assert y.grad_fn is not None and forward.packed is None
    y.sum().backward()
    assert linear.weight.grad is not None
    half = layer(1024, 256).to(torch.bfloat16)
    xb = torch.randn(64, 256, dtype=torch.bfloat16)
    assert torch.equal(PackedForward(half)(xb), F.linear(xb, half.weight, half.bias))


def test_attached_only_inside_the_block_and_refused_off_the_cpu():
    model = torch.nn.Sequential(layer(1024, 256), torch.nn.ReLU(), layer(256, 1024, seed=1))
    linears = OneDNNLinears(model)
    x = torch.randn(32, 256)
    expected = model(x)
    with linears.attached():
        assert all(isinstance(m.__dict__.get("forward"), PackedForward) for m in (model[0], model[2]))
        got = model(x)
    assert all("forward" not in m.__dict__ for m in (model[0], model[2]))
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="runs on the CPU"):
        OneDNNLinears(torch.nn.Linear(4, 4, device="meta"))
