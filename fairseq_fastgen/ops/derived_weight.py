"""A stand-in for ``nn.Linear.forward`` that multiplies by a copy derived from the layer's weight.

``--onednn-linear`` (oneDNN's packed copy) and ``--transposed-linear`` (a transposed copy)
each compute a layer's product from a form of its weight made once: :class:`DerivedWeightForward`
keeps that copy, makes it again when the layer's weight changes (a new tensor, or an
in-place update: the tensor's version counter), and leaves to torch's own product what the
copy does not serve (gradients, other dtypes, products too small to gain).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DerivedWeightForward:
    """Stands in for ``linear.forward``: ``product(x, copy)`` with ``copy = derive(linear.weight)``.

    Subclasses name their ``option`` (for messages) and define ``derive``, ``product`` and, where
    some products are better left to torch, ``serves``."""

    option = ""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.source: Optional[Tensor] = None  # the weight the copy was derived from, at version ``version``
        self.version = -1
        self.copy: Optional[Tensor] = None

    @staticmethod
    def derive(weight: Tensor) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def product(x: Tensor, copy: Tensor, bias: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def serves(self, x: Tensor, weight: Tensor) -> bool:
        """Whether the copy computes this product: fp32 on the CPU, without a gradient."""
        return (x.dtype == torch.float32 and weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))

    def is_current(self) -> bool:
        weight = self.linear.weight
        return weight is self.source and weight._version == self.version

    def __call__(self, x: Tensor) -> Tensor:
        linear = self.linear
        weight = linear.weight
        if x.device.type != "cpu" or weight.device.type != "cpu":
            raise ValueError(f"{self.option} runs on the CPU; this layer's input is on {x.device} and its weight "
                             f"on {weight.device}: leave the option out")
        if not self.serves(x, weight):
            return F.linear(x, weight, linear.bias)
        if not self.is_current():
            self.copy = self.derive(weight)
            self.source, self.version = weight, weight._version
        return self.product(x, self.copy, linear.bias)
