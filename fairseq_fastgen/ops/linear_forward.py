"""A stand-in for ``nn.Linear.forward`` that computes through a prepared copy of the weight.

The copy (oneDNN's packed layout, int8 rows, bfloat16) is made on first use and
made again when the layer's weight changes (a new tensor, or an in-place update:
its version counter), so a generator built once keeps serving a model that
trains between decodes.  Where the product needs a gradient, runs off the CPU or
is not one the stand-in serves, the layer's own product runs.

Subclasses say how the copy is made (:meth:`prepare`), which products it serves
(:meth:`serves`) and how it computes (:meth:`product`);
:mod:`fairseq_fastgen.adapters.linear_forwards` attaches them to a model.
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn


def has_stand_in(linear: nn.Module) -> bool:
    """Whether a stand-in (this module's kind, or anyone's) shadows ``linear.forward`` now: an instance attribute."""
    return "forward" in linear.__dict__


class LinearForward:
    """Stands in for ``linear.forward``: ``F.linear`` through ``self.packed``, the prepared weight."""

    option = "this option"  # the command-line flag, for error messages

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.source: Optional[Tensor] = None
        self.version = -1
        self.packed = None  # what prepare() made of the weight, None until first used

    def prepare(self, weight: Tensor):
        raise NotImplementedError

    def serves(self, x: Tensor, weight: Tensor) -> bool:
        raise NotImplementedError

    def product(self, x: Tensor, packed, bias: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

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
            self.packed = self.prepare(weight.detach())
            self.source, self.version = weight, weight._version
        return self.product(x, self.packed, linear.bias)
