"""The stand-in forwards of ``--onednn-linear`` and ``--transposed-linear``, each a product by a copy derived from
a layer's weight: the product against its reference (``F.linear``) within fp32 rounding, the copy made again after a weight update, torch's own product where the copy does not serve
(gradients, other dtypes), attached only while asked and only on the CPU."""

import pytest
import torch

from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears, TransposedLinears
from fairseq_fastgen.ops.onednn_linear import onednn_available
from tests.ops.test_onednn_linear import layer, rounding_bound

KINDS = [
    pytest.param(OneDNNLinears, id="onednn",
                 marks=pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")),
    pytest.param(TransposedLinears, id="transposed"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 4, 8, 37, 320])  # 37: padded to 40 rows by oneDNN's product
@pytest.mark.parametrize("out_features,in_features", [(8008, 256), (1024, 256), (256, 1024)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_product_equals_the_reference_within_rounding(kind, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    # a transposed (1, rows, in) view, as fairseq hands the projection its features
    x = torch.randn(rows, 1, in_features, generator=generator).transpose(0, 1)
    got = kind.stand_in.product(x, kind.stand_in.derive(weight), bias)
    expected = torch.nn.functional.linear(x, weight, bias)
    assert got.shape == expected.shape == (1, rows, out_features)
    assert ((got.double() - expected.double()).abs() <= rounding_bound(x, weight, bias)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_copy_is_made_again_after_a_weight_update(kind):
    linear = layer(1024, 256)
    forward = kind.stand_in(linear)
    x = torch.randn(16, 256)
    before = forward(x)
    linear.weight.mul_(2)  # in place: the tensor's version changes
    after = forward(x)
    assert torch.allclose(after, 2 * before - linear.bias, atol=1e-4)
    linear.weight = torch.nn.Parameter(torch.zeros(1024, 256), requires_grad=False)  # a new tensor
    assert torch.equal(forward(x), linear.bias.expand(16, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_and_other_dtypes_keep_torchs_product(kind):
    linear = torch.nn.Linear(256, 1024)  # a weight that needs a gradient
    forward = kind.stand_in(linear)
    y = forward(torch.randn(64, 256))
    assert y.grad_fn is not None and forward.copy is None
    y.sum().backward()
    assert linear.weight.grad is not None
    half = layer(1024, 256).to(torch.bfloat16)
    xb = torch.randn(64, 256, dtype=torch.bfloat16)
    assert torch.equal(kind.stand_in(half)(xb), torch.nn.functional.linear(xb, half.weight, half.bias))


@pytest.mark.parametrize("kind", KINDS)
def test_attached_only_inside_the_block_and_refused_off_the_cpu(kind):
    model = torch.nn.Sequential(layer(1024, 256), torch.nn.ReLU(), layer(256, 1024, seed=1))
    linears = kind(model)
    x = torch.randn(32, 256)
    expected = model(x)
    with linears.attached():
        assert all(isinstance(m.__dict__.get("forward"), kind.stand_in) for m in (model[0], model[2]))
        got = model(x)
    assert all("forward" not in m.__dict__ for m in (model[0], model[2]))
    assert all(forward.copy is not None for forward in linears.forwards.values())  # the copies did compute
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=f"{kind.stand_in.option} runs on the CPU"):
        kind(torch.nn.Linear(4, 4, device="meta"))
