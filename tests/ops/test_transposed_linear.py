"""``--transposed-linear``: the model's linear layers as products by a transposed copy of each weight.

The stand-in forward's few rows.  The op against its reference (``F.linear``) within fp32 rounding, weight
updates, gradients and attaching: tests/ops/test_linear_stand_ins.py; decoding with the option:
tests/fastseq/test_transposed_decoding.py.
"""

import torch
import torch.nn.functional as F

from fairseq_fastgen.ops.transposed_linear import (
    MIN_ROWS, TransposedForward, transpose_weight, transposed_linear,
)
from tests.ops.test_onednn_linear import layer


def test_few_rows_keep_torchs_product_and_more_go_through_the_copy():
    linear = layer(1024, 256)
    forward = TransposedForward(linear)
    few = torch.randn(2, MIN_ROWS - 1, 256)  # (MIN_ROWS - 1) x 2 rows: enough
    assert torch.equal(forward(few[:1]), F.linear(few[:1], linear.weight, linear.bias))  # torch's own, bitwise
    assert forward.copy is None  # nothing copied yet
    got = forward(few)
    assert forward.copy is not None and forward.copy.shape == (256, 1024)
    assert torch.equal(got, transposed_linear(few, transpose_weight(linear.weight), linear.bias))
