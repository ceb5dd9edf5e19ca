"""The plugin's float32 kernel (``kernels/f32_rows_cpu.cpp``) standing in for ``nn.Linear.forward``: the products of
the compiled engine's eager steps of many rows with ``--compiled-many-rows kernel`` (what ``auto`` runs on a processor
with AVX2 and no AVX-512).

On such a processor (an AMD EPYC Zen 3, one thread) torch's product (MKL's ``sgemm``) multiplied a 64-row step's
inputs with the base decoder's weights at 58-65 GFLOP/s and its vocabulary projection at 46-60; the kernel's passes
for many rows (six rows by 16 outputs of sums in registers, the weights of a few hundred outputs at a time, read
from the cache by every six rows) at 87-90 and 89-94 (``python benchmarks/f32_step_products.py --rows 64,320``).
Each output is the kernel's one sum in input order whatever the row count: a row's outputs are the same bits alone or
among others, not torch's bits (a product in other sums; the share of identical hypotheses is measured in
docs/benchmarks.md).  The weight is packed once (the kernel's layout, a copy in blocks of 8 outputs) and again when
it changes (:class:`~fairseq_fastgen.ops.linear_forward.LinearForward`).
"""

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from fairseq_fastgen.ops import int8_kernel
from fairseq_fastgen.ops.aligned_rows import folds
from fairseq_fastgen.ops.linear_forward import LinearForward


def many_rows_kernel_available() -> bool:
    """Whether the kernel's passes for many rows run here: wherever the kernel does (its one build, AVX2 with FMA, runs
    on AVX-512 processors too)."""
    return int8_kernel.f32_rows_available()


class F32RowsForward(LinearForward):
    """Stands in for ``linear.forward``: the product through the kernel, on its layout of the weight."""

    option = "--compiled-many-rows kernel"

    def __init__(self, linear: nn.Linear, shared_layout: Callable[[nn.Linear], Optional[Tensor]] = lambda _: None):
        super().__init__(linear)
        self.shared_layout = shared_layout  # linear -> the kernel's layout of its current weight held elsewhere

    def prepare(self, weight: Tensor) -> Tensor:
        shared = self.shared_layout(self.linear)
        return torch.ops.fastgen.f32_rows_pack(weight) if shared is None else shared

    def serves(self, x: Tensor, weight: Tensor) -> bool:  # gradients and other dtypes: torch's
        return (x.dtype == torch.float32 and weight.dtype == torch.float32 and folds(x, weight)
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def product(self, x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
        rows = x.reshape(-1, x.size(-1))  # (rows, in)
        out = torch.ops.fastgen.f32_rows_linear(rows, packed, bias, self.linear.weight.size(0))  # (rows, out)
        return out.view(*x.shape[:-1], out.size(-1))

