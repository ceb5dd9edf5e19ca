"""The float32 products of the compiled engine's frozen units of a few rows: the row buckets (greedy at batch 1 to 4)
and blockwise's verification at batch 1 and 2 (rows x positions per row: 4 at batch 1 with k = 4).

Such a unit multiplies a few rows with every weight of the decoder, and its time is that of reading them.
oneDNN's prepacked products and inductor's C++ GEMM template read the weights more slowly at 4 rows than at one
(and the template's unit holds its own packed copy of them); the plugin's kernel of a few rows
(``kernels/f32_rows_cpu.cpp``, ``torch.ops.fastgen.f32_rows_linear``) reads each weight once for all of them.  The
units read its layout of the weights in place (``shares_constants``): one copy in blocks of 8 outputs
(``f32_rows_pack``, streamed from memory in order) that every unit shares; no copy of the weights per unit.

A unit of more than ``MAX_ROWS`` rows of products keeps oneDNN's (the kernel reads a weight once for up to 8 input
rows; more take passes over a few outputs' weights at a time).  A row's products are the same bits alone or among
others, so a block's verification and a one-position step read the same products; their attention is computed
apart.
"""

from typing import List, Optional

import torch
from torch import Tensor, nn

from fairseq_fastgen.engine.layer_weights import LayerWeights

MAX_ROWS = 8  # rows of a unit's products (rows x positions) up to which the kernel beats oneDNN's


class F32RowsLayer(nn.Module):
    """A linear layer's weight in the kernel's layout (a copy in blocks of 8 outputs) and its own bias: ``self(x)``
    is its product, x (..., in) -> (..., out)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        super().__init__()
        self.out_features = weight.size(0)
        self.register_buffer("weight", torch.ops.fastgen.f32_rows_pack(weight))  # f32_rows_pack's layout, float32
        self.register_buffer("bias", None if bias is None else bias.detach())  # (out,)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.size(-1))  # (rows, in)
        out = torch.ops.fastgen.f32_rows_linear(rows, self.weight, self.bias, self.out_features)  # (rows, out)
        return out.view(*x.shape[:-1], self.out_features)


class F32RowsWeights(LayerWeights):
    """Every linear layer of ``decoder`` (a fairseq decoder) and each layer's fused query/key/value rows
    (``qkv_weights``/``qkv_biases``: ``fused_weights.FusedWeights``'s) through the kernel of a few rows."""

    shares_constants = True

    def __init__(self, decoder: nn.Module, qkv_weights: List[Tensor], qkv_biases: List[Optional[Tensor]]):
        super().__init__(decoder, qkv_weights, qkv_biases, F32RowsLayer, takes=lambda linear: True)
        # each linear layer held: (its name, the data and version of its weight packed)
        self.sources = {id(module): (name, module.weight.data_ptr(), module.weight._version)
                        for name, module in decoder.named_modules() if self.layer(name) is not None}

    def packed(self, linear: nn.Linear) -> Optional[Tensor]:
        """The kernel's layout of ``linear``'s weight as these layers hold it, where it is the weight's current
        one (``--compiled-many-rows kernel`` reads it rather than packing a copy of its own), else None."""
        name, data, version = self.sources.get(id(linear), (None, None, None))
        if name is None or (data, version) != (linear.weight.data_ptr(), linear.weight._version):
            return None
        return self.layer(name).weight


def serves(rows: Optional[int], block: int) -> bool:
    """Whether a unit of ``block`` positions for ``rows`` rows (None: any count) computes through the kernel, where
    it runs (``int8_kernel.f32_rows_available()``)."""
    return rows is not None and rows * block <= MAX_ROWS
