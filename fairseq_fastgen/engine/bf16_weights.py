"""The decoder's linear layers in bfloat16 inside the compiled units (``--quantize bf16 --step-engine compiled``).

Each layer holds its weight rounded to bfloat16 once; its product rounds the input to bfloat16, sums in float32
and rounds the output to bfloat16, as the static engine's stand-in does (``precision_linear.bf16_linear``).  The
units are frozen: inductor packs these weights into its own products' layout (its C++ GEMM template at a few rows,
oneDNN's above), half the bytes of float32's, so a step reads half the weights' memory.  The vocabulary
projection stays float32, as under the static engine: logits rounded to bfloat16 would tie where float32's differ
by a hair.  The product is the same arithmetic as static bf16's but summed by other kernels, so the last bits of
a sum can round to another bfloat16: the same tokens where candidates are not that close (the tests hold them
equal on the toy model).
"""

from typing import List, Optional

import torch
from torch import Tensor, nn

from fairseq_fastgen.engine.layer_weights import LayerWeights
from fairseq_fastgen.ops.precision_linear import bf16_linear


class Bf16Layer(nn.Module):
    """A linear layer's weight in bfloat16 and its bias in float32 as buffers: ``self(x)`` is its product,
    x (..., in) float32 -> (..., out) float32."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())  # (out, in)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # (out,)

    def forward(self, x: Tensor) -> Tensor:
        return bf16_linear(x, self.weight, self.bias)


class Bf16Weights(LayerWeights):
    """Every linear layer of ``decoder`` the units call in bfloat16 (the fused query/key/value rows
    ``qkv_weights``/``qkv_biases`` too), the vocabulary projection float32."""

    def __init__(self, decoder: nn.Module, qkv_weights: List[Tensor], qkv_biases: List[Optional[Tensor]]):
        super().__init__(decoder, qkv_weights, qkv_biases, Bf16Layer, takes=lambda linear: True,
                         kept=getattr(decoder, "output_projection", None))
