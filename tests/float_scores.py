"""Scores that two units compute in different summation orders."""

import torch

# Without AVX-512, inductor's vectorized float sums (of one row, of a block's rows) and ATen's take other orders than
# each other, so two units' scores can differ in their last bits while their tokens stay the same.
SAME_BITS_ACROSS_UNITS = torch.cpu._is_avx512_supported()


def assert_same_scores(got: torch.Tensor, expected: torch.Tensor, same_bits: bool, label) -> None:
    """``got`` is ``expected`` bit for bit where ``same_bits``, else to float32's rounding (rtol 1e-5)."""
    if same_bits:
        assert torch.equal(got, expected), label
    else:
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), label
