"""The plugin's float32 kernel (``kernels/f32_rows_cpu.cpp``, ``torch.ops.fastgen.f32_rows_linear``): F.linear's
result within float32 rounding at every row count and shape, with and without bias, a few rows and many (the passes
of many rows over the weights of 256 outputs at a time); each row's outputs bitwise the same whatever rows are
multiplied beside it and on one thread or two (blockwise's verification of a block and a one-position step read the
same products; a sentence's outputs do not depend on its batch); misuse is a one-line error.  Where the processor has
AVX-512 or AVX2 the kernel must be there (its one build, AVX2 with FMA, runs on both)."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_fastgen.ops import int8_kernel

pytestmark = pytest.mark.skipif(int8_kernel.processor_refusal() is not None,
                                reason="the kernels are built for AVX-512 or AVX2")


@pytest.fixture(autouse=True, scope="module")
def loaded_kernel():
    """The kernels built and loaded in this process (each test may run alone, in any worker)."""
    int8_kernel.available()


def product(x, weight, bias):
    """The kernel's product of x (rows, in) with ``weight`` (out, in) in its own layout."""
    return torch.ops.fastgen.f32_rows_linear(x, torch.ops.fastgen.f32_rows_pack(weight), bias, weight.size(0))


def weight_bias_inputs(out_features, in_features, rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 2, rows).unsqueeze(1)
    return weight, bias, x


def test_the_kernel_is_built_with_avx512_or_avx2():
    assert int8_kernel.f32_rows_available()


# (out, in): the base model's attention and fused query/key/value, FFN in and out, its 32k vocabulary (a prime);
# shapes that are not whole groups of 4 outputs nor whole 16-float loads of inputs
@pytest.mark.parametrize("shape", [(512, 512), (1536, 512), (2048, 512), (512, 2048), (32003, 512), (7, 3), (70, 33)])
# one pass of up to 4 rows, and many: passes of 6 rows and a pass of 1 to 5 after whole ones (13, 64)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 13, 64])
def test_the_kernel_gives_linears_products_and_each_rows_bits_alone(shape, rows):
    weight, bias, x = weight_bias_inputs(*shape, rows)
    for with_bias in (bias, None):
        got = product(x, weight, with_bias)
        assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
        exact = F.linear(x.double(), weight.double(), None if with_bias is None else with_bias.double())
        scale = x.double().abs() @ weight.double().abs().t() + (0 if with_bias is None else with_bias.double().abs())
        assert bool(((got.double() - exact).abs() <= 1e-5 * scale + 1e-30).all())  # float32's rounding of the sums
        alone = torch.cat([product(x[r: r + 1], weight, with_bias) for r in range(rows)])
        assert torch.equal(got, alone)
        reversed_rows = product(x.flip(0), weight, with_bias).flip(0)
        assert torch.equal(got, reversed_rows)


@pytest.mark.parametrize("rows", [4, 64])
def test_two_threads_give_one_threads_bits(rows):
    weight, bias, x = weight_bias_inputs(32003, 512, rows)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x, weight, bias)
        torch.set_num_threads(2)
        two = product(x, weight, bias)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_strided_inputs_are_read_as_their_values():
    weight, bias, x = weight_bias_inputs(64, 48, 6)
    transposed = x.t().contiguous().t()  # the same values, column-major
    assert torch.equal(product(transposed, weight, bias),
                       product(x, weight, bias))


@pytest.mark.parametrize("x,weight,out_features,message", [
    (torch.randn(2, 8), torch.randn(4, 9), 4, "f32_rows_linear: x \\(rows, in\\) and f32_rows_pack's weight"),
    (torch.randn(2, 8), torch.randn(4, 8), 12, "f32_rows_linear: x \\(rows, in\\) and f32_rows_pack's weight"),
    (torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), 4, "f32_rows_pack: float32 only"),
    (torch.randn(2, 8), torch.randn(4, 8, 1), 4, "f32_rows_pack: a weight \\(out, in\\)"),
])
def test_misuse_is_one_line(x, weight, out_features, message):
    with pytest.raises(RuntimeError, match=message) as error:
        torch.ops.fastgen.f32_rows_linear(x, torch.ops.fastgen.f32_rows_pack(weight), None, out_features)
    assert str(error.value).strip().splitlines()[0].startswith(("f32_rows_linear", "f32_rows_pack"))
