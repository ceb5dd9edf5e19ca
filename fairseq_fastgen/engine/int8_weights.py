"""The decoder's int8 rows as buffers of the compiled units (``--quantize int8 --step-engine compiled``).

Under ``--quantize int8`` the static engine computes each linear layer through a stand-in of the layer's
``forward`` (``adapters/linear_forwards.py``).  A compiled unit is traced once and keeps what it traced, so
its products cannot go through stand-ins: here every linear layer the decoder step calls holds its int8 rows
(``precision_linear.Int8Rows``, the plugin's kernel's layout) as buffers of one module, and the step calls
the kernel's op, ``torch.ops.fastgen.int8_rows_linear``, on them.  Inductor's freezing makes the buffers
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


# layers the units never call through these rows: each self-attention's query/key/value (one fused product, self.qkv)
# and the encoder-decoder keys/values (computed once per decode, eager, through --quantize's stand-ins)
NOT_IN_UNITS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "encoder_attn.k_proj",
                "encoder_attn.v_proj")


def takes_int8(linear: nn.Linear) -> bool:
    """Whether ``--quantize int8`` computes ``linear`` in int8 (its weight large enough)."""
    return linear.weight.numel() >= precision_linear.MIN_INT8_WEIGHT


class Int8Weights(nn.Module):
    """The int8 layers of ``decoder`` (a fairseq decoder): every ``nn.Linear`` under it that int8 serves, the
    vocabulary projection unless ``float32_vocabulary``, and each layer's fused query/key/value rows
    (``qkv_weights``/``qkv_biases``: ``fused_weights.FusedWeights``'s)."""

    def __init__(self, decoder: nn.Module, qkv_weights: List[Tensor], qkv_biases: List[Optional[Tensor]],
                 float32_vocabulary: bool):
        super().__init__()
        if not int8_kernel.available():
            raise RuntimeError("the compiled engine's int8 units need the plugin's int8 kernel")
        kept = getattr(decoder, "output_projection", None) if float32_vocabulary else None
        self.layers = nn.ModuleDict()  # the layer's name among the decoder's modules, dots as "_" -> its rows
        with torch.no_grad():
            for name, module in decoder.named_modules():
                if (isinstance(module, nn.Linear) and module is not kept and takes_int8(module)
                        and not name.endswith(NOT_IN_UNITS)):
                    self.layers[name.replace(".", "_")] = Int8Layer(module.weight, module.bias)
            # per layer: the fused query/key/value rows where the layer's projections take int8, else an Identity
            self.qkv = nn.ModuleList([
                Int8Layer(weight, bias) if takes_int8(layer.self_attn.q_proj) else nn.Identity()
                for layer, weight, bias in zip(decoder.layers, qkv_weights, qkv_biases)
            ])

    def layer(self, name: str) -> Optional[Int8Layer]:
        """The int8 rows of the decoder's linear layer ``name`` ("layers.0.fc1"), or None where it keeps its
        float32 product.  (By name: torch.export traces a copy of the modules.)"""
        key = name.replace(".", "_")
        return self.layers[key] if key in self.layers else None

    def qkv_layer(self, index: int) -> Optional[Int8Layer]:
        """Layer ``index``'s fused query/key/value rows, or None (float32)."""
        rows = self.qkv[index]
        return rows if isinstance(rows, Int8Layer) else None
