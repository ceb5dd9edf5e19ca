"""``fairseq-train --cpu --amp``: mixed precision in bfloat16 on the CPU.

fairseq's ``--amp`` autocasts through ``torch.cuda.amp`` only, so on the CPU it trains in float32 while its log
says amp (and ``--bf16`` there asks for a TPU). On a processor with native bfloat16 products (AVX-512 BF16 or AMX)
the plugin runs each training step's forward under ``torch.autocast("cpu", torch.bfloat16)``: the products and
their gradients in bfloat16, the weights, the optimizer and the checkpoint float32, as ``--amp`` keeps them on a
GPU. A transformer-base update of about 7k target tokens took 8.5 s against 21 s in float32 on the 2-core AMD EPYC
(Zen 5) (docs/benchmarks.md, Model sizes). Without native bfloat16 one warning line says so and training stays
float32 (autocast would emulate the products, slower than float32). Native is not always faster: on an Intel Xeon
with AVX-512 BF16 but no AMX, torch's bfloat16 product of a base update's shapes ran 155 GFLOP/s on 2 threads against
252 in float32. So before the first step the plugin times one product of those shapes in each precision
(``precision_linear.bfloat16_rates``, about 0.2 s) and autocasts only where bfloat16 is the faster; else one warning
line gives both rates and training stays float32. ``--amp`` then still wraps the optimizer as fairseq does, so a
checkpoint resumes with ``--amp`` on a machine of either kind.

fairseq's loss scaler (``torch.cuda.amp.GradScaler``) disables itself without CUDA; bfloat16 has float32's
exponent range and needs no loss scaling.
"""

import contextlib
import logging

import torch

from fairseq_fastgen.ops import precision_linear

logger = logging.getLogger(__name__)

_warned = False


def native_bfloat16() -> bool:
    """Whether this processor multiplies bfloat16 natively (AVX-512 BF16 or AMX) and torch reaches it (oneDNN):
    where ``--quantize bf16`` runs."""
    return precision_linear.precision_refusal("bf16") is None


def wants_cpu_autocast(model, optimizer) -> bool:
    """``--amp`` (fairseq wraps the optimizer in its AMPOptimizer) on a model whose weights are on the CPU."""
    from fairseq.optim.amp_optimizer import AMPOptimizer

    if not isinstance(optimizer, AMPOptimizer):
        return False
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


def training_precision(model, optimizer):
    """The context a training step runs in: bfloat16 autocast for ``--cpu --amp`` where the processor has native
    bfloat16 products and they are faster than its float32 ones."""
    global _warned
    if not wants_cpu_autocast(model, optimizer):
        return contextlib.nullcontext()
    if native_bfloat16():
        reason = precision_linear.bfloat16_slower()
        if reason is None:
            return torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        reason = "this processor has no native bfloat16 products (AVX-512 BF16 or AMX)"
    if not _warned:
        _warned = True
        logger.warning("--amp on the CPU: %s, so training stays float32", reason)
    return contextlib.nullcontext()
