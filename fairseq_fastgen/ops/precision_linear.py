"""The model's linear layers in int8 or bfloat16 on the CPU (``--quantize``).

At a few rows a decoder step reads every weight once and does little else, so
it runs at the speed of memory: fewer bytes per weight go faster.

* int8: each weight row rounded once to int8 with a float32 scale of its own,
  the input rounded at each call, one scale per input row, and the integer
  product summed in int32 by fbgemm's dynamic quantized linear (torch's
  ``quantized::linear_dynamic``, VNNI where the processor has it).  fbgemm
  takes one range for the whole input; each row is therefore divided by its
  largest magnitude first, and two fence rows ``[1, 0, ...]`` and ``[-1, 0, ...]`` pin that range
  to [-1, 1]: a row is rounded the same whatever rows share its call, the int32
  sums are exact, so its output is bitwise the same at batch 1 and 64, in a
  blockwise block or a stream's refill (``tests/ops/test_precision_linear.py``).
  Within int8 the decoders' exactness promises therefore hold as in float32.
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

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_fastgen.ops.linear_forward import LinearForward

PRECISIONS = ("int8", "bf16")
# int8 rows cost four more small torch calls a product (the rows' magnitudes, the division, the fence, the
# rescale), which a small weight does not win back: on one thread of our Xeon a 512 x 512 weight takes about 3x
# float32's time at one row in int8 rows and the same at 64, a 2048 x 512 one about as long at one row and 0.6x
# at 64, the 32k x 512 vocabulary projection 0.2x and 0.5x (benchmarks/precision_products.py). Weights below this
# many entries keep their float32 product; the choice depends on the weight's shape only, so a row's result still
# does not depend on the rows beside it.
MIN_INT8_WEIGHT = 1 << 20


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


def prepack_int8_rows(weight: Tensor, bias: Optional[Tensor] = None):
    """weight (out, in) rounded to int8 rows, one float scale each, and ``bias`` (out,) or None, packed for
    fbgemm's ``quantized::linear_dynamic``."""
    weight = weight.detach().float().contiguous()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # (out,)
    zero_points = torch.zeros(weight.size(0), dtype=torch.long)
    with warnings.catch_warnings():  # torch announces the removal of quantized tensors
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        rows = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(rows, None if bias is None else bias.detach().float())


class Int8Rows:
    """A weight (out, in) as int8 rows with one scale each, prepared for fbgemm's dynamic linear."""

    def __init__(self, weight: Tensor):
        self.packed = prepack_int8_rows(weight)
        # (2, in): two rows [1, 0, ...] and [-1, 0, ...] that fix fbgemm's input range to [-1, 1]
        self.fence = torch.zeros(2, weight.size(1))
        self.fence[0, 0], self.fence[1, 0] = 1.0, -1.0
        # without VNNI fbgemm sums pairs of products in int16 and needs 7-bit inputs to stay clear of saturation
        self.reduce_range = not torch.cpu._is_vnni_supported()

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., in) float32 -> (..., out) float32, each row rounded on a scale of its own."""
        rows = x.reshape(-1, x.size(-1))  # (rows, in)
        # (rows, 1); abs().amax: torch's infinity norm over rows takes 10x longer at 64 rows and more
        magnitudes = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
        unit_rows = torch.cat([rows / magnitudes, self.fence])  # (rows + 2, in), every value in [-1, 1]
        out = torch.ops.quantized.linear_dynamic(unit_rows, self.packed, self.reduce_range)  # (rows + 2, out)
        return out[:-2].mul_(magnitudes).view(*x.shape[:-1], out.size(-1))


def int8_linear(x: Tensor, rows: Int8Rows, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``rows = Int8Rows(weight)``: x (..., in) -> (..., out)."""
    out = rows(x)
    return out if bias is None else out + bias.detach()


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
