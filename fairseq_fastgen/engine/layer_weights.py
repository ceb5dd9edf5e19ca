"""The decoder's linear layers in reduced precision inside the compiled units (``--quantize`` with
``--step-engine compiled``).

Under ``--quantize`` the static engine computes each linear layer through a stand-in of the layer's ``forward``
(``adapters/linear_forwards.py``).  A compiled unit is traced once and keeps what it traced, so its products cannot
go through stand-ins: instead the decoder step (``DecoderStep.reduced``) holds one module per linear layer it
calls, and calls it by the layer's name.  :class:`LayerWeights` collects them; each precision says what a layer
holds and how it multiplies (``int8_weights.py``, ``bf16_weights.py``).  Each self-attention's query, key and value
rows are one product, as the compiled engine's float32 step fuses them.
"""

from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

# layers the units never call through these modules: each self-attention's query/key/value (one fused product,
# LayerWeights.qkv) and the encoder-decoder keys/values (computed once per decode, outside the units:
# CompiledRunner.encoder_keys_product)
NOT_IN_UNITS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "encoder_attn.k_proj",
                "encoder_attn.v_proj")


class LayerWeights(nn.Module):
    """The layers of ``decoder`` (a fairseq decoder) in a reduced precision: every ``nn.Linear`` under it that
    ``takes`` accepts, but ``kept`` (a layer that keeps its float32 product, or None), as ``layer_class(weight,
    bias)``; and each layer's fused query/key/value rows (``qkv_weights``/``qkv_biases``:
    ``fused_weights.FusedWeights``'s) where ``takes`` accepts its query projection.

    ``shares_constants``: whether a unit reads these tensors in place (compiled without them), else it holds them
    as constants of its own (prepacked by inductor's freezing)."""

    shares_constants = False

    def __init__(self, decoder: nn.Module, qkv_weights: List[Tensor], qkv_biases: List[Optional[Tensor]],
                 layer_class: Callable[[Tensor, Optional[Tensor]], nn.Module],
                 takes: Callable[[nn.Linear], bool], kept: Optional[nn.Module] = None):
        super().__init__()
        self.layers = nn.ModuleDict()  # the layer's name among the decoder's modules, dots as "_" -> its module
        with torch.no_grad():
            for name, module in decoder.named_modules():
                if (isinstance(module, nn.Linear) and module is not kept and takes(module)
                        and not name.endswith(NOT_IN_UNITS)):
                    self.layers[name.replace(".", "_")] = layer_class(module.weight.detach(), module.bias)
            # per layer: the fused query/key/value rows where its projections take the precision, else an Identity
            self.qkv = nn.ModuleList([
                layer_class(weight.detach(), bias) if takes(layer.self_attn.q_proj) else nn.Identity()
                for layer, weight, bias in zip(decoder.layers, qkv_weights, qkv_biases)
            ])

    def layer(self, name: str) -> Optional[nn.Module]:
        """The module computing the decoder's linear layer ``name`` ("layers.0.fc1"), or None where it keeps its
        float32 product.  (By name: torch.export traces a copy of the modules.)"""
        key = name.replace(".", "_")
        return self.layers[key] if key in self.layers else None

    def qkv_layer(self, index: int) -> Optional[nn.Module]:
        """Layer ``index``'s fused query/key/value module, or None (float32)."""
        rows = self.qkv[index]
        return None if isinstance(rows, nn.Identity) else rows
