"""Generation under ``torch.inference_mode`` instead of ``torch.no_grad`` (off: ``--no-inference-mode``).

Stock fairseq generates under ``torch.no_grad``.  Every torch call there still
keeps autograd's bookkeeping: version counters bumped by in-place writes, and
the base of every view recorded.  Under ``torch.inference_mode`` tensors carry
neither, so each call costs less; the kernels, and therefore the values, are
the same.  Decoding at small batches on the CPU makes hundreds of small calls
per step, where this bookkeeping is a visible share of the time
(docs/benchmarks.md, "FastSeq's optimizations for stock beam search").

Tensors made under inference mode refuse in-place writes outside it, and
fairseq-generate writes into the hypotheses it gets (it converts their
positional scores to base 2 in place).  The wrapper therefore returns copies
made outside inference mode: a few small tensors per hypothesis, against the
hundreds of calls per step it saves.
"""

import torch
from torch import Tensor

from fairseq_fastgen.adapters.generate import generate_within


def generate_in_inference_mode(generator):
    """``generator.generate`` runs under ``torch.inference_mode`` (every decoder, stock beam search
    included; integration.py calls it unless ``--no-inference-mode``)."""
    generate_within(generator, torch.inference_mode, after=ordinary_tensors)


def ordinary_tensors(value):
    """``value`` (tensors in lists, tuples and dicts: a generator's hypotheses) with every
    inference tensor replaced by an ordinary copy, which can be written in place."""
    if isinstance(value, Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, dict):
        return {key: ordinary_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(ordinary_tensors(item) for item in value)
    return value
