"""A model's linear layers through another form of their weights while a generator generates: oneDNN's packed
copy (``--onednn-linear``) or a transposed copy (``--transposed-linear``).

Each ``nn.Linear`` gets a stand-in forward (:class:`~fairseq_fastgen.ops.onednn_linear.PackedForward`,
:class:`~fairseq_fastgen.ops.transposed_linear.TransposedForward`) as an instance attribute ``forward``
shadowing the method, removed on exit (as the cluster projection attaches to ``output_layer``).  The ops,
their references and their measurements: :mod:`fairseq_fastgen.ops.onednn_linear`,
:mod:`fairseq_fastgen.ops.transposed_linear`.
"""

import contextlib
from typing import Dict

from torch import nn

from fairseq_fastgen.adapters.generate import generate_within, give_attributes
from fairseq_fastgen.ops.derived_weight import DerivedWeightForward
from fairseq_fastgen.ops.onednn_linear import PackedForward, onednn_available
from fairseq_fastgen.ops.transposed_linear import TransposedForward


class LinearStandIns:
    """A ``stand_in`` forward for every ``nn.Linear`` of ``model``, attached while :meth:`attached` runs."""

    stand_in = DerivedWeightForward  # the class of a layer's stand-in (its ``option`` names it in messages)

    def __init__(self, model: nn.Module):
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise ValueError(f"{self.stand_in.option} runs on the CPU; the model is on "
                             f"{', '.join(sorted(devices))}: leave the option out")
        self.model = model
        self.forwards: Dict[int, DerivedWeightForward] = {}

    def linears(self):
        return [m for m in self.model.modules() if isinstance(m, nn.Linear)]

    @contextlib.contextmanager
    def attached(self):
        """Inside the block, the model's linear layers compute through their stand-ins."""
        attached = []
        try:
            for linear in self.linears():  # looked up each time: a layer may have been replaced
                if "forward" in linear.__dict__:
                    continue  # someone else's stand-in: leave it
                forward = self.forwards.get(id(linear))
                if forward is None or forward.linear is not linear:
                    forward = self.forwards[id(linear)] = self.stand_in(linear)
                linear.__dict__["forward"] = forward  # an instance attribute, without nn.Module's setattr checks
                attached.append(linear)
            yield
        finally:
            for linear in attached:
                del linear.__dict__["forward"]


class OneDNNLinears(LinearStandIns):
    stand_in = PackedForward

    def __init__(self, model: nn.Module):
        if not onednn_available():
            raise ValueError("--onednn-linear needs a torch built with oneDNN (mkldnn); this one has none: "
                             "leave the option out")
        super().__init__(model)


class TransposedLinears(LinearStandIns):
    stand_in = TransposedForward


def use_linear_stand_ins(generator, models, common):
    """``--onednn-linear`` / ``--transposed-linear``: ``generator.generate`` computes the linear layers of
    ``models`` through the option's stand-ins (every decoder, stock beam search included); neither: nothing."""
    if common.onednn_linear and common.transposed_linear:
        raise ValueError("--onednn-linear and --transposed-linear each choose the linear layers' product: "
                         "give one of them")
    if common.transposed_linear and str(common.step_engine) == "compiled":
        raise ValueError("--transposed-linear applies to the eager steps of --step-engine fairseq and static; "
                         "the compiled engine's units choose their own products: leave the option out")
    kind = OneDNNLinears if common.onednn_linear else TransposedLinears if common.transposed_linear else None
    if kind is None:
        return
    linears = [kind(model) for model in models]

    @contextlib.contextmanager
    def every_model_attached():
        with contextlib.ExitStack() as stack:
            for model_linears in linears:
                stack.enter_context(model_linears.attached())
            yield

    generate_within(generator, every_model_attached)
    give_attributes(generator, linear_stand_ins=linears)
