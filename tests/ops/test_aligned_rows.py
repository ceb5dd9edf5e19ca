"""The vocabulary projection's logits in aligned rows (ops/aligned_rows.py): the bits of ``F.linear``, each row of
the result a multiple of 16 floats after the last, and the runners' projection through it."""

import pytest
import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerDecoderBase
from torch import nn

from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears
from fairseq_fastgen.engine.fairseq_runner import vocabulary_logits
from fairseq_fastgen.engine.fused_weights import plain_output_projection
from fairseq_fastgen.ops.aligned_rows import ROW_FLOATS, aligned_rows_linear, aligns, folds, padded_width
from fairseq_fastgen.ops.onednn_linear import onednn_available


@pytest.mark.parametrize("rows", [2, 3, 5, 8, 17, 64, 100, 320])
@pytest.mark.parametrize("columns,inner", [(32003, 512), (1871, 64)])
def test_aligned_rows_give_the_bits_of_f_linear(rows, columns, inner):
    generator = torch.Generator().manual_seed(rows * columns)
    weight = nn.Parameter(torch.randn(columns, inner, generator=generator) * 0.05)  # a model's, as decoded
    # (1, rows, in) transposed to (rows, 1, in), as a decoder step hands its features to the projection
    x = torch.randn(1, rows, inner, generator=generator).transpose(0, 1)
    with torch.inference_mode():
        got, expected = aligned_rows_linear(x, weight), F.linear(x, weight)
    assert got.shape == expected.shape == (rows, 1, columns)
    assert torch.equal(got, expected)
    assert torch.equal(F.log_softmax(got, dim=-1), F.log_softmax(expected, dim=-1))
    row_stride = padded_width(columns)
    assert got.stride(0) == row_stride and got.stride(-1) == 1 and row_stride % ROW_FLOATS == 0
    assert got.data_ptr() % (4 * ROW_FLOATS) == 0  # every row on a 64-byte boundary


def test_several_positions_per_row_keep_their_layout():
    weight, x = torch.randn(1001, 32), torch.randn(6, 4, 32)  # (rows, positions, dim): a blockwise verification
    got = aligned_rows_linear(x, weight)
    assert got.shape == (6, 4, 1001) and torch.equal(got, F.linear(x, weight))
    assert torch.equal(got[:, -1, :], F.linear(x[:, -1, :], weight))


def test_rows_torch_multiplies_one_by_one_are_left_to_torch():
    """Without a gradient on the weight, torch multiplies a transposed step's (rows, 1, in) row by row (other sums
    than one product of the rows): those keep F.linear's own result."""
    weight = torch.randn(1001, 64) * 0.05
    step_rows = torch.randn(1, 9, 64).transpose(0, 1)  # (9, 1, 64), rows 64 apart, positions 9 x 64 apart
    assert not folds(step_rows, weight) and folds(step_rows, nn.Parameter(weight))
    assert folds(step_rows.contiguous().view(9, 64), weight) and folds(torch.randn(9, 1, 64), weight)
    got = aligned_rows_linear(step_rows, weight)
    assert got.is_contiguous() and torch.equal(got, F.linear(step_rows, weight))


def test_only_misaligned_float32_rows_without_gradients_are_padded():
    x = torch.randn(8, 1, 32)
    assert aligns(x, torch.randn(1001, 32))
    assert not aligns(x, torch.randn(1000, 32))  # rows already 32 bytes apart
    assert not aligns(torch.randn(1, 1, 32), torch.randn(1001, 32))  # one row: nothing to align
    assert not aligns(x.double(), torch.randn(1001, 32).double())
    trained = torch.randn(1001, 32, requires_grad=True)
    assert not aligns(x, trained)
    with torch.no_grad():
        assert aligns(x, trained)
    one_row, aligned_width = aligned_rows_linear(torch.randn(1, 32), trained), aligned_rows_linear(x, torch.randn(1000, 32))
    assert one_row.is_contiguous() and aligned_width.is_contiguous()


class Decoder(nn.Module):
    """fairseq's ``output_layer`` over a bias-free projection of an odd width (what a dictionary given as a file
    can have), or a projection with a bias, which the plain path leaves to the decoder."""

    adaptive_softmax = None

    def __init__(self, columns=1001, bias=False):
        super().__init__()
        self.output_projection = nn.Linear(32, columns, bias=bias).requires_grad_(False)

    output_layer = TransformerDecoderBase.output_layer  # fairseq's own


def test_runner_projection_writes_aligned_rows_only_where_the_decoder_projects_plainly():
    features = torch.randn(8, 1, 32)
    plain, biased = Decoder(), Decoder(bias=True)
    assert plain_output_projection(plain) is plain.output_projection and plain_output_projection(biased) is None
    logits = vocabulary_logits(plain, features)
    assert not logits.is_contiguous() and torch.equal(logits, plain.output_projection(features))
    assert vocabulary_logits(biased, features).is_contiguous()


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_an_attached_stand_in_keeps_its_own_product():
    decoder = Decoder()
    assert plain_output_projection(decoder) is decoder.output_projection
    features = torch.randn(64, 1, 32)
    with torch.inference_mode(), OneDNNLinears(decoder).attached():
        logits = vocabulary_logits(decoder, features)
        assert torch.equal(logits, decoder.output_projection(features))  # oneDNN's product, contiguous
        assert logits.is_contiguous()
