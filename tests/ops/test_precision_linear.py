"""``--quantize``'s products against ``F.linear`` on the float32 weight: int8 rows rounded per input row (a row's
output bitwise the same whatever rows share its call), bfloat16 within its rounding, the stand-ins following
weight updates and leaving gradients to torch, and a processor without the instructions refused in one line."""

import logging

import pytest
import torch
import torch.nn.functional as F

from fairseq_fastgen.adapters.linear_forwards import QuantizedLinears
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import engine_setting
from fairseq_fastgen.ops import precision_linear
from fairseq_fastgen.ops.precision_linear import (
    MIN_INT8_WEIGHT, BFloat16Forward, Int8Forward, Int8Rows, bf16_linear, int8_linear,
    precision_refusal,
)

int8_here = pytest.mark.skipif(precision_refusal("int8") is not None, reason="no int8 products on this CPU")
bf16_here = pytest.mark.skipif(precision_refusal("bf16") is not None, reason="no bfloat16 products on this CPU")


def weight_and_bias(out_features=384, in_features=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    return weight, torch.randn(out_features, generator=generator)


def relative_error(got, expected):
    return ((got - expected).norm() / expected.norm()).item()


@int8_here
def test_int8_rows_give_each_row_the_same_bits_whatever_rows_share_the_call():
    weight, bias = weight_and_bias()
    rows = Int8Rows(weight)
    # rows of very different magnitudes: one range for the whole input would round the small ones coarsely
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64).unsqueeze(1)
    together = int8_linear(x, rows, bias)  # (64, 384)
    alone = torch.cat([int8_linear(x[i:i + 1], rows, bias) for i in range(64)])
    assert torch.equal(together, alone)
    assert torch.equal(int8_linear(x[5:12], rows, bias), together[5:12])
    blocks = x.view(16, 4, 256)  # (rows, block positions, dim), as blockwise verification shapes it
    assert torch.equal(int8_linear(blocks, rows, bias), together.view(16, 4, 384))
    expected = F.linear(x, weight, bias)
    per_row = [relative_error(together[i], expected[i]) for i in range(64)]
    assert max(per_row) < 0.03  # every row rounded on its own scale, the smallest ones too


onednn_int8_here = pytest.mark.skipif(
    not (torch.cpu._is_vnni_supported() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
    reason="no oneDNN int8 product in this torch or processor")


@int8_here
@onednn_int8_here
@pytest.mark.parametrize("shape", [(384, 256), (2048, 512), (512, 2048)])  # (out, in)
def test_int8_rows_give_the_same_bits_in_fbgemm_and_in_onednn(monkeypatch, shape):
    monkeypatch.setattr(precision_linear, "onednn_int8_fast", lambda: True)  # its bits, on a reference path too
    weight, bias = weight_and_bias(*shape)
    rows = Int8Rows(weight, kernel=False)  # the library kernels (the plugin's own: tests/ops/test_int8_kernel.py)
    x = torch.randn(40, shape[1]) * torch.logspace(-2, 2, 40).unsqueeze(1)
    x[0] = weight[0].sign()  # an int32 sum near its largest for one output
    monkeypatch.setattr(precision_linear, "ONEDNN_MIN_ROWS", 10 ** 9)
    in_fbgemm = [int8_linear(x, rows, bias), int8_linear(x[:3], rows, bias)]
    assert rows.onednn is None  # not packed: no call had the rows for it
    monkeypatch.setattr(precision_linear, "ONEDNN_MIN_ROWS", 1)
    in_onednn = [int8_linear(x, rows, bias), int8_linear(x[:3], rows, bias)]
    assert rows.onednn is not None
    for fbgemm, onednn in zip(in_fbgemm, in_onednn):
        assert torch.equal(fbgemm, onednn)


@int8_here
def test_int8_rows_of_zeros_give_the_bias():
    weight, bias = weight_and_bias()
    assert torch.equal(int8_linear(torch.zeros(3, 256), Int8Rows(weight), bias), bias.expand(3, -1))


@bf16_here
def test_bf16_products_stay_within_bfloat16_rounding():
    weight, bias = weight_and_bias()
    x = torch.randn(16, 256)
    got = bf16_linear(x, weight.bfloat16(), bias)
    assert got.dtype == torch.float32
    assert relative_error(got, F.linear(x, weight, bias)) < 0.01


@pytest.mark.parametrize("forward_class", [pytest.param(Int8Forward, marks=int8_here),
                                           pytest.param(BFloat16Forward, marks=bf16_here)])
def test_the_stand_in_follows_weight_updates_and_leaves_gradients_to_torch(forward_class):
    linear = torch.nn.Linear(1024, 1024)  # as large as MIN_INT8_WEIGHT
    forward = forward_class(linear)
    x = torch.randn(8, 1024)
    with torch.no_grad():
        first = forward(x)
        packed = forward.packed
        assert forward(x) is not None and forward.packed is packed  # prepared once
        linear.weight.mul_(2)  # in place: the version counter moves
        second = forward(x)
    assert forward.packed is not packed
    assert relative_error(second - linear.bias, 2 * (first - linear.bias)) < 0.03
    y = forward(x)  # the weight needs a gradient: torch's own product
    assert y.grad_fn is not None and torch.equal(y, F.linear(x, linear.weight, linear.bias))


@int8_here
def test_int8_keeps_the_float32_product_of_a_weight_below_the_threshold():
    small = torch.nn.Linear(256, 256)  # a toy model's attention projection: int8 rows cost more than they save
    large = torch.nn.Linear(512, 512)  # a base model's
    assert small.weight.numel() < MIN_INT8_WEIGHT <= large.weight.numel()
    with torch.no_grad():
        x = torch.randn(3, 256)
        assert torch.equal(Int8Forward(small)(x), F.linear(x, small.weight, small.bias))
        forward = Int8Forward(large)
        x = torch.randn(3, 512)
        assert not torch.equal(forward(x), F.linear(x, large.weight, large.bias)) and forward.packed is not None


def test_a_processor_without_the_instructions_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for precision, needed in [("bf16", "AVX-512 BF16 or AMX"), ("int8", "AVX2")]:
        with pytest.raises(ValueError, match=needed) as refusal:
            QuantizedLinears(model, precision)
        assert "\n" not in str(refusal.value)


def test_the_bfloat16_and_float32_rates_are_measured_once_a_process():
    precision_linear.bfloat16_rates.cache_clear()
    first = precision_linear.bfloat16_rates()
    assert all(rate > 0 for rate in first) and precision_linear.bfloat16_rates() is first


@bf16_here
@pytest.mark.parametrize("rates, warned", [((155.0, 252.0), True), ((400.0, 252.0), False)])
def test_quantize_bf16_says_once_where_bfloat16_products_are_slower_than_float32(monkeypatch, caplog, rates, warned):
    monkeypatch.setattr(precision_linear, "bfloat16_rates", lambda: rates)
    monkeypatch.setattr("fairseq_fastgen.engine.choice._slow_bfloat16_named", [])
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        for engine in ("static", "compiled", "static"):
            engine_setting(PluginOptions(step_engine=engine, quantize="bf16"))
        engine_setting(PluginOptions(step_engine="static"))  # float32: nothing to say
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--quantize bf16")]
    assert len(lines) == (1 if warned else 0)  # once a process, and only where bfloat16 is the slower
    assert all("155 against 252 GFLOP/s" in line and "without --quantize" in line for line in lines)


@int8_here
@onednn_int8_here
@pytest.mark.parametrize("fast", [True, False])
def test_the_library_kernels_take_onednn_only_where_its_int8_product_is_not_on_a_reference_path(monkeypatch, fast):
    monkeypatch.setattr(precision_linear, "onednn_int8_fast", lambda: fast)
    monkeypatch.setattr(precision_linear, "ONEDNN_MIN_ROWS", 1)
    rows = Int8Rows(weight_and_bias(512, 512)[0], kernel=False)
    int8_linear(torch.randn(4, 512), rows, None)
    assert rows.has_onednn is fast and (rows.onednn is not None) is fast  # packed and called only where it is fast


@onednn_int8_here
def test_the_onednn_probe_runs_once_a_process():
    precision_linear.onednn_int8_fast.cache_clear()
    first = precision_linear.onednn_int8_fast()
    assert isinstance(first, bool) and precision_linear.onednn_int8_fast.cache_info().misses == 1
    assert precision_linear.onednn_int8_fast() is first and precision_linear.onednn_int8_fast.cache_info().hits == 1
