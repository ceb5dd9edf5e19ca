"""The decoder's int8 rows as buffers of the compiled units (``--quantize int8 --step-engine compiled``).

Every linear layer the decoder step calls holds its int8 rows (``precision_linear.Int8Rows``, the plugin's
kernel's layout) as buffers of one module (``layer_weights.LayerWeights``), and the step calls the kernel's op,
``torch.ops.fastgen.int8_rows_linear``, on them.  Inductor's freezing makes the buffers
constants of the unit; its package is compiled without them (``aot_step.StepPackage.shares_constants``) and
reads these buffers in place, so every unit of a decode shares one copy of the rows (made again in each process:
about 0.2 s at base size).

The layers are those the stand-ins would serve (weights of ``MIN_INT8_WEIGHT`` entries and more; the
vocabulary projection unless ``--float32-vocabulary-projection``); the others keep their float32 product.  Each
self-attention's query, key and value rows are one product, as the compiled engine's float32 step fuses them:
an output row's int8 scale is its own and an input row's depends on the input only, so the fused product gives
the three products' bits.
"""

from typing import List, Optional

import torch
from torch import Tensor, nn

from fairseq_fastgen.engine.layer_weights import LayerWeights
from fairseq_fastgen.ops import int8_kernel, precision_linear
from fairseq_fastgen.ops.precision_linear import Int8Rows


class Int8Layer(nn.Module):
    """A linear layer's int8 rows and bias as buffers: ``self(x)`` is its product, x (..., in) -> (..., out)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        super().__init__()
        rows = Int8Rows(weight, kernel=True).kernel
        self.out_features = weight.size(0)
        self.register_buffer("packed", rows.packed)  # (out/64, in/4, 64, 4) int8
        self.register_buffer("scales", rows.scales)  # (out padded to 64,) float32
        self.register_buffer("offsets", rows.offsets)  # (out padded to 64,) int32
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # (out,)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.fastgen.int8_rows_linear(x.reshape(-1, x.size(-1)), self.packed, self.scales, self.offsets,
                                                 self.out_features, self.bias)  # (rows, out)
        return out.view(*x.shape[:-1], self.out_features)


def takes_int8(linear: nn.Linear) -> bool:
    """Whether ``--quantize int8`` computes ``linear`` in int8 (its weight large enough)."""
    return linear.weight.numel() >= precision_linear.MIN_INT8_WEIGHT


class Int8Weights(LayerWeights):
    """The int8 layers of ``decoder`` (a fairseq decoder): every ``nn.Linear`` under it that int8 serves, the
    vocabulary projection unless ``float32_vocabulary``, and each layer's fused query/key/value rows
    (``qkv_weights``/``qkv_biases``: ``fused_weights.FusedWeights``'s).  The units read them in place."""

    shares_constants = True

    def __init__(self, decoder: nn.Module, qkv_weights: List[Tensor], qkv_biases: List[Optional[Tensor]],
                 float32_vocabulary: bool):
        if not int8_kernel.available():
            raise RuntimeError("the compiled engine's int8 units need the plugin's int8 kernel")
        kept = getattr(decoder, "output_projection", None) if float32_vocabulary else None
        super().__init__(decoder, qkv_weights, qkv_biases, Int8Layer, takes_int8, kept)
