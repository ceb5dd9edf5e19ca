"""A model's linear layers through oneDNN's packed product while a generator generates (``--onednn-linear``).

Each ``nn.Linear`` gets a :class:`~fairseq_fastgen.ops.onednn_linear.PackedForward`
as an instance attribute ``forward`` shadowing the method, removed on exit (as
the cluster projection attaches to ``output_layer``).  The op, its reference and
its measurements: :mod:`fairseq_fastgen.ops.onednn_linear`.
"""

import contextlib
from typing import Dict

from torch import nn

from fairseq_fastgen.adapters.generate import generate_within, give_attributes
from fairseq_fastgen.ops.onednn_linear import PackedForward, onednn_available


class OneDNNLinears:
    """The packed forwards of every ``nn.Linear`` of ``model``, attached while :meth:`attached` runs."""

    def __init__(self, model: nn.Module):
        if not onednn_available():
            raise ValueError("--onednn-linear needs a torch built with oneDNN (mkldnn); this one has none: "
                             "leave the option out")
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise ValueError(f"--onednn-linear runs on the CPU; the model is on {', '.join(sorted(devices))}: "
                             f"leave the option out")
        self.model = model
        self.forwards: Dict[int, PackedForward] = {}

    def linears(self):
        return [m for m in self.model.modules() if isinstance(m, nn.Linear)]

    @contextlib.contextmanager
    def attached(self):
        """Inside the block, the model's linear layers compute through oneDNN."""
        attached = []
        try:
            for linear in self.linears():  # looked up each time: a layer may have been replaced
                if "forward" in linear.__dict__:
                    continue  # someone else's stand-in: leave it
                forward = self.forwards.get(id(linear))
                if forward is None or forward.linear is not linear:
                    forward = self.forwards[id(linear)] = PackedForward(linear)
                linear.__dict__["forward"] = forward  # an instance attribute, without nn.Module's setattr checks
                attached.append(linear)
            yield
        finally:
            for linear in attached:
                del linear.__dict__["forward"]


def use_onednn_linears(generator, models):
    """``--onednn-linear``: ``generator.generate`` computes the linear layers of ``models``
    through oneDNN (every decoder, stock beam search included)."""
    linears = [OneDNNLinears(model) for model in models]

    @contextlib.contextmanager
    def every_model_attached():
        with contextlib.ExitStack() as stack:
            for model_linears in linears:
                stack.enter_context(model_linears.attached())
            yield

    generate_within(generator, every_model_attached)
    give_attributes(generator, onednn_linears=linears)
