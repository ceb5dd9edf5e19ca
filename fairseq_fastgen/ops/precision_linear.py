"""The model's linear layers in int8 or bfloat16 on the CPU (``--quantize``).

At a few rows a decoder step reads every weight once and does little else, so
it runs at the speed of memory: fewer bytes per weight go faster.

* int8: each weight row rounded once to int8 with a float32 scale of its own,
  each input row rounded at each call to integers on a scale of its own, and
  their product summed exactly in int32: by the plugin's own kernel
  (``int8_kernel.py``, AVX-512 VNNI or AVX2) where it builds, else by fbgemm's dynamic linear at a few rows and
  oneDNN's int8 linear at more (:class:`Int8Rows`).  A row's output is
  bitwise the same at batch 1 and 64, in any of the three kernels, in a
  blockwise block or a stream's refill
  (``tests/ops/test_precision_linear.py``): within int8 the decoders'
  exactness promises hold as in float32.
* bfloat16: the weight stored in bfloat16, the input rounded to bfloat16, the
  product summed in float32 by oneDNN (AMX or AVX-512 BF16 where present) and
  its output rounded to bfloat16 (torch has no bfloat16 product with a float32
  output on the CPU), float32 again after.  The vocabulary projection stays
  float32 (``adapters/linear_forwards.py``): logits rounded to bfloat16 tie
  exactly where float32's differ by a hair, and greedy's argmax and beam
  search's top-k break ties apart.  Refused on processors without those
  instructions.

Attention, layer norms and softmaxes stay float32 in both.  The reference of
each product is ``F.linear`` on the float32 weight; the tests bound the
difference.
"""

import functools
import time
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_fastgen.ops import int8_kernel
from fairseq_fastgen.ops.linear_forward import LinearForward

PRECISIONS = ("int8", "bf16")
# Through fbgemm's product int8 rows cost five more small torch calls a product (the rows' magnitudes, their scales,
# the division and rounding, the rescale), which a small weight does not win back: in int8 the toy model's 256 x 256
# attention weights are slower than in float32 at one row and no faster at many; the base model's 512 x 512 ones no
# slower at one row and faster at many.  The plugin's kernel has no such cost, but the threshold stays the same on
# every processor, so that the same layers are int8 whichever kernel runs.
# Weights below this many entries keep their float32 product; the choice depends on the weight's shape only, so a
# row's result still does not depend on the rows beside it.
MIN_INT8_WEIGHT = 1 << 18


def precision_refusal(precision: str) -> Optional[str]:
    """Why ``--quantize precision`` cannot run on this processor and torch build, or None."""
    if precision == "int8":
        if "x86" not in torch.backends.quantized.supported_engines and \
                "fbgemm" not in torch.backends.quantized.supported_engines:
            return "--quantize int8 needs torch's x86 (fbgemm) quantized engine, which this torch build lacks"
        if not torch.cpu._is_avx2_supported():
            return "--quantize int8 needs a processor with AVX2 (fbgemm's int8 kernels); this one has none"
        return None
    if precision == "bf16":
        if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            return ("--quantize bf16 needs a processor with AVX-512 BF16 or AMX (native bfloat16 products); "
                    "this one has neither: leave the option out or use --quantize int8")
        if not torch.backends.mkldnn.is_available():
            return "--quantize bf16 needs a torch built with oneDNN (mkldnn); this one has none"
        return None
    return f"--quantize must be one of {', '.join(PRECISIONS)}; got {precision!r}"


INPUT_LEVELS = int8_kernel.INPUT_LEVELS  # each input row rounded to integers in [-INPUT_LEVELS, INPUT_LEVELS]
# From this many rows a call goes to oneDNN's int8 product, below to fbgemm's; the two give the same bits
# (tests/ops/test_precision_linear.py). fbgemm's product is the cheaper at a few rows, oneDNN's at many.
ONEDNN_MIN_ROWS = 16


def fastest_seconds(call, timings: int = 3) -> float:
    """The fastest of ``timings`` timed calls of ``call``, after one untimed (the library picks and builds its
    kernel)."""
    call()
    fastest = float("inf")
    for _ in range(timings):
        start = time.perf_counter()
        call()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


@functools.lru_cache(maxsize=None)
def bfloat16_rates() -> Tuple[float, float]:
    """GFLOP/s of one product of a transformer-base training update's shapes (8,192 rows by 512 inputs, by 2,048
    outputs) in bfloat16 and in float32 on the CPU, torch's threads, the fastest of 3 timings each, measured once
    per process (about 0.2 s). Native bfloat16 is not always the faster: on an Intel Xeon with AVX-512 BF16 but no
    AMX it ran 155 GFLOP/s on 2 threads against float32's 252, and in inference it was slower at most shapes too
    (a 512 x 512 weight at every row count; the vocabulary's at 64 rows 28.7 ms against 17.7:
    ``benchmarks/precision_products.py``)."""
    def rate(dtype) -> float:
        x, weight = torch.randn(8192, 512, dtype=dtype), torch.randn(2048, 512, dtype=dtype)
        return 2 * 8192 * 512 * 2048 / fastest_seconds(lambda: F.linear(x, weight)) / 1e9

    with torch.no_grad():
        return rate(torch.bfloat16), rate(torch.float32)


def bfloat16_slower() -> Optional[str]:
    """Where this processor's bfloat16 products are no faster than its float32 ones (``bfloat16_rates``; ask where
    they are native: ``precision_refusal("bf16")`` None), why, with both rates, in words; else None."""
    bfloat16, float32 = bfloat16_rates()
    if bfloat16 > float32:
        return None
    return (f"this processor's bfloat16 products are slower than its float32 ones ({bfloat16:.0f} against "
            f"{float32:.0f} GFLOP/s, one product of a base update's shapes timed now)")


def onednn_int8_available() -> bool:
    """oneDNN's int8 product, where it runs and is not on a reference path (``onednn_int8_fast``)."""
    return (torch.cpu._is_vnni_supported() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.onednn, "qlinear_pointwise") and onednn_int8_fast())


ONEDNN_PROBE_SHAPE = (16, 256, 256)  # rows, in, out: the fewest rows oneDNN's product serves (ONEDNN_MIN_ROWS)


@functools.lru_cache(maxsize=None)
def onednn_int8_fast() -> bool:
    """Whether oneDNN's int8 product runs at least about as fast as fbgemm's here, timed once a process on
    ``ONEDNN_PROBE_SHAPE``. Where torch's oneDNN has no int8 kernel for the processor it takes a reference path: on
    an AMD EPYC (Zen 5) 4.4 ms for one row of a 512 x 512 weight against fbgemm's 25 us, on an Intel Xeon with VNNI
    but no AMX 8.8 ms against 42 us (``benchmarks/precision_products.py``)."""
    rows, in_features, out_features = ONEDNN_PROBE_SHAPE
    integers = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scales, zero_points = torch.full((out_features,), 0.01), torch.zeros(out_features, dtype=torch.long)
    x = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8)
    with warnings.catch_warnings():  # torch announces the removal of quantized tensors
        warnings.filterwarnings("ignore", message=".*quantized tensor.*")
        quantized = torch._make_per_channel_quantized_tensor(integers, scales.double(), zero_points, 0)
        fbgemm_packed = torch.ops.quantized.linear_prepack(quantized, None)
    onednn_packed = torch.ops.onednn.qlinear_prepack(integers, None)

    def fbgemm():
        torch.ops.quantized.linear_dynamic(x.float(), fbgemm_packed, False)

    def onednn():
        torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, onednn_packed, scales, zero_points, None, 1.0, 0,
                                           torch.float32, "none", [], "")

    with torch.no_grad():
        return fastest_seconds(onednn) <= 2 * fastest_seconds(fbgemm)


def rounded_weight(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """weight (out, in) float32 -> its integers (out, in) (whole numbers in [-127, 127], float32) and scales (out,):
    each row on its largest magnitude over 127, half to even, as ``Int8Rows`` holds it."""
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
    return torch.round(weight / scales.unsqueeze(1)), scales


def rounded_inputs(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """rows (rows, in) float32 -> their integers (rows, in) (whole numbers in [-INPUT_LEVELS, INPUT_LEVELS], float32)
    and scales (rows, 1): each row on its largest magnitude over INPUT_LEVELS, half to even, as every int8 kernel
    rounds its inputs."""
    # abs().amax: torch's infinity norm over rows is much slower at many rows
    scales = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(INPUT_LEVELS)  # (rows, 1)
    return torch.round(rows / scales), scales


class Int8Rows:
    """A weight (out, in) as int8 rows with one float32 scale each, and its product with float32 input rows.

    An input row is divided by its own scale (its largest magnitude over ``INPUT_LEVELS``) and rounded to
    integers; the product of those integers with the weight's is summed exactly in int32, scaled by the weight
    row's scale, then by the input row's, then the bias is added.  Three kernels compute it with the same bits
    (tests/ops/test_precision_linear.py, tests/ops/test_int8_kernel.py):

    * the plugin's own (``int8_kernel.py``, AVX-512 VNNI or AVX2): rounding, product and scaling in one call, at every
      row count; used wherever it builds (``kernel``: None asks ``int8_kernel.available()``);
    * else fbgemm's at a few rows (``quantized::linear_dynamic``: it rounds its input once more, on one range for
      the whole call, which two fence rows of +-(INPUT_LEVELS + 0.5) pin to a scale of exactly 1, so the integers
      pass unchanged), and oneDNN's from ``ONEDNN_MIN_ROWS`` rows (``onednn::qlinear_pointwise`` on int8 inputs).

    A row's result depends neither on the kernel nor on the rows beside it."""

    def __init__(self, weight: Tensor, kernel: Optional[bool] = None):
        weight = weight.detach().float().contiguous()
        self.out_features = weight.size(0)
        integers, self.scales = rounded_weight(weight)  # (out, in), (out,)
        integers = integers.to(torch.int8)
        if kernel is None:
            kernel = int8_kernel.available()
        self.kernel = int8_kernel.KernelRows(integers, self.scales) if kernel else None
        self.fbgemm = self.onednn = self.integers = None
        if self.kernel is not None:
            return
        self.zero_points = torch.zeros(weight.size(0), dtype=torch.long)  # (out,)
        with warnings.catch_warnings():  # torch announces the removal of quantized tensors
            warnings.filterwarnings("ignore", message=".*quantized tensor.*")
            rows = torch._make_per_channel_quantized_tensor(integers, self.scales.double(), self.zero_points, 0)
            self.fbgemm = torch.ops.quantized.linear_prepack(rows, None)
        self.has_onednn = onednn_int8_available()
        self.integers = integers if self.has_onednn else None  # packed for oneDNN on first use, then dropped
        # (2, in): two rows that fix fbgemm's input range to +-(INPUT_LEVELS + 0.5), a scale of 1
        self.fence = torch.zeros(2, weight.size(1))
        self.fence[0, 0], self.fence[1, 0] = INPUT_LEVELS + 0.5, -INPUT_LEVELS - 0.5
        self.reduce_range = INPUT_LEVELS < 127  # fbgemm's 7-bit inputs

    def __call__(self, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """x (..., in) float32 -> (..., out) float32, each row rounded on a scale of its own; bias (out,) or None."""
        rows = x.reshape(-1, x.size(-1))  # (rows, in)
        if self.kernel is not None:
            out = self.kernel(rows, None if bias is None else bias.detach())
            return out.view(*x.shape[:-1], self.out_features)
        integers, input_scales = rounded_inputs(rows)  # (rows, in), (rows, 1)
        if self.has_onednn and rows.size(0) >= ONEDNN_MIN_ROWS:
            if self.onednn is None:  # a run that never has this many rows never packs it
                self.onednn, self.integers = torch.ops.onednn.qlinear_prepack(self.integers, None), None
            out = torch.ops.onednn.qlinear_pointwise(
                integers.to(torch.int8), 1.0, 0, self.onednn, self.scales, self.zero_points, None, 1.0, 0,
                torch.float32, "none", [], "")  # (rows, out)
        else:
            out = torch.ops.quantized.linear_dynamic(torch.cat([integers, self.fence]), self.fbgemm,
                                                     self.reduce_range)[:-2]  # (rows, out)
        out = out.mul_(input_scales).view(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias.detach()


def int8_linear(x: Tensor, rows: Int8Rows, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``rows = Int8Rows(weight)``: x (..., in) -> (..., out)."""
    return rows(x, bias)


def bf16_linear(x: Tensor, weight_bf16: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``weight_bf16 = weight.bfloat16()``, the product in bfloat16 summed in
    float32: x (..., in) float32 -> (..., out) float32."""
    out = F.linear(x.to(torch.bfloat16), weight_bf16).float()
    return out if bias is None else out + bias.detach()


def quantized_serves(x: Tensor, weight: Tensor) -> bool:
    """fp32 products without gradients: the others (training, other dtypes) keep torch's own."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() > 0
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


class Int8Forward(LinearForward):
    """Stands in for ``linear.forward``: the product on int8 rows (``--quantize int8``)."""

    option = "--quantize int8"

    def prepare(self, weight: Tensor) -> Int8Rows:
        return Int8Rows(weight)

    def serves(self, x: Tensor, weight: Tensor) -> bool:
        return weight.numel() >= MIN_INT8_WEIGHT and quantized_serves(x, weight)

    def product(self, x: Tensor, packed: Int8Rows, bias: Optional[Tensor]) -> Tensor:
        return int8_linear(x, packed, bias)


class LibraryInt8Forward(Int8Forward):
    """``--quantize int8 --int8-library-kernels``: the same product through fbgemm's and oneDNN's kernels."""

    option = "--int8-library-kernels"

    def prepare(self, weight: Tensor) -> Int8Rows:
        return Int8Rows(weight, kernel=False)


class BFloat16Forward(LinearForward):
    """Stands in for ``linear.forward``: the product in bfloat16 (``--quantize bf16``)."""

    option = "--quantize bf16"

    def prepare(self, weight: Tensor) -> Tensor:
        return weight.to(torch.bfloat16).contiguous()

    def serves(self, x: Tensor, weight: Tensor) -> bool:
        return quantized_serves(x, weight)

    def product(self, x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
        return bf16_linear(x, packed, bias)


FORWARDS = {"int8": Int8Forward, "bf16": BFloat16Forward}
