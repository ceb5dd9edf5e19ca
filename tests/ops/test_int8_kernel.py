"""The plugin's int8 kernel (``kernels/int8_rows_cpu.cpp``) gives the bits of fbgemm's product on the same int8
rows (``Int8Rows(kernel=False)``, itself tested bitwise against oneDNN's) at every row count and shape, with and
without bias, on one thread and two; misuse is a one-line error.  Where the processor has AVX-512 VNNI or AVX2 the
kernel must build (the build for the processor: inputs in [-127, 127] with VNNI, [-63, 63] with AVX2): a failed
build fails here instead of silently falling back."""

import os
import subprocess
import sys

import pytest
import torch

from fairseq_fastgen.ops import int8_kernel
from fairseq_fastgen.ops.precision_linear import Int8Rows, int8_linear, precision_refusal

pytestmark = pytest.mark.skipif(
    precision_refusal("int8") is not None or int8_kernel.processor_refusal() is not None,
    reason="the plugin's int8 kernel needs AVX-512 VNNI or AVX2")


def weight_bias_inputs(out_features, in_features, rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    bias = torch.randn(out_features, generator=generator)
    # rows of very different magnitudes, one of zeros, one that drives an int32 sum near its largest
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0] = weight[0].sign() * 5
    if rows > 2:
        x[1] = 0
    return weight, bias, x


def test_the_kernel_builds_where_the_processor_has_the_instructions():
    assert int8_kernel.available()
    assert Int8Rows(torch.randn(64, 64)).kernel is not None  # --quantize int8 takes it by default
    # where the processor has AMX (and FASTGEN_INT8_TILES does not leave it out), 16 rows or more run on its tiles
    assert torch.ops.fastgen.int8_rows_tiles() == int8_kernel.AMX


def test_the_prefetch_hint_is_one_of_the_four_or_the_import_ends_in_one_line():
    # the kernels are built with FASTGEN_PREFETCH_HINT's hint (T1 unless set): one the compiler knows, or no build
    assert "-DFASTGEN_PREFETCH_HINT=_MM_HINT_T1" in int8_kernel.FLAGS or "FASTGEN_PREFETCH_HINT" in os.environ
    env = dict(os.environ, FASTGEN_PREFETCH_HINT="L1")
    result = subprocess.run([sys.executable, "-c", "import fairseq_fastgen.ops.int8_kernel"], env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["FASTGEN_PREFETCH_HINT=L1: one of T0, T1, T2, NTA"]


# (out, in): the base model's attention, FFN in and out; a toy model's; shapes that are not whole groups of 64
# outputs nor of 4 inputs, nor of the kernel's 16-float loads
@pytest.mark.parametrize("shape", [(512, 512), (2048, 512), (512, 2048), (256, 256), (1003, 90), (7, 3), (70, 33)])
# (on AMX: from 16 rows on, in blocks of 32 rows and tiles of 16: a block of one tile, two, one padded)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 17, 40, 64])
def test_the_kernel_gives_fbgemms_bits(shape, rows):
    weight, bias, x = weight_bias_inputs(*shape, rows)
    own, library = Int8Rows(weight, kernel=True), Int8Rows(weight, kernel=False)
    for with_bias in (bias, None):
        expected = int8_linear(x, library, with_bias)
        got = int8_linear(x, own, with_bias)
        assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
        assert torch.equal(got, expected)
    blocks = int8_linear(x.view(1, rows, shape[1]), own, bias)  # (rows, block positions, dim) as blockwise shapes it
    assert torch.equal(blocks.view(rows, shape[0]), int8_linear(x, library, bias))


@pytest.mark.parametrize("rows", [6, 40])  # (on AMX: 40 rows run on its tiles)
def test_the_vocabulary_projection_gives_the_same_bits_on_one_thread_and_two(rows):
    weight, bias, x = weight_bias_inputs(32003, 512, rows)  # 16 MiB of int8 rows: the kernel splits it over threads
    own = Int8Rows(weight, kernel=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8_linear(x, own, bias)
        torch.set_num_threads(2)
        two = int8_linear(x, own, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, int8_linear(x, Int8Rows(weight, kernel=False), bias))


def test_rows_of_zeros_give_the_bias_and_no_rows_give_no_rows():
    weight, bias, _ = weight_bias_inputs(384, 256, 1)
    own = Int8Rows(weight, kernel=True)
    assert torch.equal(int8_linear(torch.zeros(3, 256), own, bias), bias.expand(3, -1))
    assert int8_linear(torch.zeros(0, 256), own, bias).shape == (0, 384)


def test_misuse_of_the_op_is_a_one_line_error():
    weight, bias, x = weight_bias_inputs(128, 64, 2)
    rows = Int8Rows(weight, kernel=True).kernel
    for bad in (x.double(), torch.randn(2, 65)):
        with pytest.raises(RuntimeError, match="int8_rows_linear") as error:
            rows(bad, None)
        assert len(str(error.value).strip().splitlines()) == 1
