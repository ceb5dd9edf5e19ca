"""A model's linear layers through another product while a generator generates (``--onednn-linear``,
``--quantize``).

Each ``nn.Linear`` gets a :class:`~fairseq_fastgen.ops.linear_forward.LinearForward`
(oneDNN's packed fp32, int8 rows, bfloat16) as an instance attribute ``forward``
shadowing the method, removed on exit (as the cluster projection attaches to
``output_layer``).  fairseq's attention modules compute a non-incremental
attention (the encoder's) with torch's fused function, which reads the
projection weights itself; while ``--quantize``'s stand-ins are attached they
take fairseq's own path, which calls the projections.  The products, their references and measurements:
:mod:`fairseq_fastgen.ops.onednn_linear`, :mod:`fairseq_fastgen.ops.precision_linear`.
"""

import contextlib
from typing import Callable, Dict, Iterable, Optional, Type

from torch import Tensor, nn

from fairseq.modules import MultiheadAttention

from fairseq_fastgen.adapters.generate import generate_within, give_attributes
from fairseq_fastgen.ops.f32_rows_linear import F32RowsForward
from fairseq_fastgen.ops.linear_forward import LinearForward, has_stand_in
from fairseq_fastgen.ops.onednn_linear import PackedForward, onednn_available
from fairseq_fastgen.ops.precision_linear import FORWARDS, LibraryInt8Forward, precision_refusal


class LinearForwards:
    """The stand-in forwards (``forward_class``) of every ``nn.Linear`` of ``model`` but ``kept``, attached while
    :meth:`attached` runs."""

    # fairseq's attention modules take their own path while attached, so that the stand-ins compute their
    # projections too (else torch's fused attention reads those weights in float32)
    attention_through_projections = False

    def __init__(self, model: nn.Module, forward_class: Type[LinearForward], kept: Iterable[nn.Module] = ()):
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise ValueError(f"{forward_class.option} runs on the CPU; the model is on {', '.join(sorted(devices))}: "
                             f"leave the option out")
        self.model = model
        self.forward_class = forward_class
        self.kept = {id(module) for module in kept}  # layers that keep their own product
        self.forwards: Dict[int, LinearForward] = {}

    def make_forward(self, linear: nn.Linear) -> LinearForward:
        return self.forward_class(linear)

    def linears(self):
        return [m for m in self.model.modules() if isinstance(m, nn.Linear) and id(m) not in self.kept]

    @contextlib.contextmanager
    def attached(self):
        """Inside the block, the model's linear layers compute through their stand-ins."""
        attached, attentions = [], []
        try:
            for linear in self.linears():  # looked up each time: a layer may have been replaced
                if has_stand_in(linear):
                    continue  # someone else's stand-in: leave it
                forward = self.forwards.get(id(linear))
                if forward is None or forward.linear is not linear:
                    forward = self.forwards[id(linear)] = self.make_forward(linear)
                linear.__dict__["forward"] = forward  # an instance attribute, without nn.Module's setattr checks
                attached.append(linear)
            for attention in self.model.modules() if self.attention_through_projections else ():
                if isinstance(attention, MultiheadAttention) and not attention.skip_embed_dim_check:
                    attention.skip_embed_dim_check = True  # fairseq's path: it calls q_proj, k_proj, v_proj
                    attentions.append(attention)
            yield
        finally:
            for linear in attached:
                del linear.__dict__["forward"]
            for attention in attentions:
                attention.skip_embed_dim_check = False


class OneDNNLinears(LinearForwards):
    """``--onednn-linear``: every linear layer through oneDNN's packed fp32 product."""

    def __init__(self, model: nn.Module):
        if not onednn_available():
            raise ValueError("--onednn-linear needs a torch built with oneDNN (mkldnn); this one has none: "
                             "leave the option out")
        super().__init__(model, PackedForward)


class F32RowsLinears(LinearForwards):
    """``--compiled-many-rows kernel``: the linear layers of ``module`` (the decoder, the encoder) through the plugin's
    float32 kernel, on the kernel's layout of each weight that ``shared_layout(linear)`` gives (the compiled units'
    copy), else their own."""

    def __init__(self, module: nn.Module, shared_layout: Callable[[nn.Linear], Optional[Tensor]] = lambda _: None):
        super().__init__(module, F32RowsForward)
        self.shared_layout = shared_layout

    def make_forward(self, linear: nn.Linear) -> LinearForward:
        return F32RowsForward(linear, self.shared_layout)


def output_projections(model: nn.Module):
    """The vocabulary projections of ``model``'s decoder (fairseq's ``output_projection``)."""
    decoder = getattr(model, "decoder", model)
    projection = getattr(decoder, "output_projection", None)
    return [projection] if isinstance(projection, nn.Linear) else []


class QuantizedLinears(LinearForwards):
    """``--quantize int8|bf16``: every linear layer in that precision, the vocabulary projection in float32 with
    bf16 or ``float32_vocabulary``; ``library_kernels``: int8 through fbgemm's and oneDNN's kernels
    (``--int8-library-kernels``)."""

    attention_through_projections = True

    def __init__(self, model: nn.Module, precision: str, float32_vocabulary: bool = False,
                 library_kernels: bool = False):
        refusal = precision_refusal(precision)
        if refusal:
            raise ValueError(refusal)
        # bfloat16 products give bfloat16 outputs: logits rounded so, candidates a hair apart would tie exactly
        float32_vocabulary = float32_vocabulary or precision == "bf16"
        forward_class = LibraryInt8Forward if library_kernels and precision == "int8" else FORWARDS[precision]
        super().__init__(model, forward_class, output_projections(model) if float32_vocabulary else ())


def use_linear_forwards(generator, linears):
    """``generator.generate`` computes the linear layers of each model through ``linears`` (one
    :class:`LinearForwards` a model; every decoder, stock beam search included)."""

    @contextlib.contextmanager
    def every_model_attached():
        with contextlib.ExitStack() as stack:
            for model_linears in linears:
                stack.enter_context(model_linears.attached())
            yield

    generate_within(generator, every_model_attached)
    give_attributes(generator, linear_forwards=linears)
