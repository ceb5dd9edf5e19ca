"""top_token gives exactly topk(1)'s values and indices: the greedy decoders' choice of a step's token."""

import pytest
import torch

from fairseq_fastgen.ops.top_token import MAX_ROWS, MIN_ROWS, block_size, top_token


def assert_as_topk(scores):
    values, indices = top_token(scores)
    expected = scores.topk(1, dim=-1)
    assert values.shape == indices.shape == (scores.size(0), 1)
    assert indices.dtype == torch.long
    assert torch.equal(indices, expected.indices)
    assert torch.equal(values, expected.values)


@pytest.mark.parametrize("vocab", [8008, 32000, 8009, 32003, 131, 50])  # a divisor block, 128, a short last block
@pytest.mark.parametrize("rows", [1, MAX_ROWS, MIN_ROWS, 16, 64, 320])
def test_log_probabilities_of_a_step(rows, vocab):
    generator = torch.Generator().manual_seed(rows * vocab)
    assert_as_topk(torch.randn(rows, vocab, generator=generator).log_softmax(dim=-1))


# each case alone (one row: max), beside one more row (two: max), and among many (the blocks)
SHOWN_WITH = [0, 1, 63]


@pytest.mark.parametrize("others", SHOWN_WITH)
@pytest.mark.parametrize("vocab", [8008, 8009])
def test_ties_take_the_first_index_as_topk(vocab, others):
    generator = torch.Generator().manual_seed(0)
    for case in range(3):
        scores = torch.randint(0, 4, (1 + others, vocab), generator=generator).float()  # many tied maxima a row
        if case == 0:
            scores[0] = 0.0  # every score tied
        elif case == 1:
            scores[0, vocab - 1] = 9.0  # the maximum in the last (short) block
        else:
            scores[0, [3, vocab - 2]] = 9.0  # tied in the first and the last block
            assert int(top_token(scores)[1][0]) == 3
        assert_as_topk(scores)


@pytest.mark.parametrize("others", SHOWN_WITH)
def test_rows_of_minus_infinity_and_eos_only_rows(others):
    for allowed in [None, 2]:  # every token banned; only eos allowed, at its score (max length reached)
        scores = torch.randn(1 + others, 8008).log_softmax(dim=-1)
        scores[0] = -torch.inf
        if allowed is not None:
            scores[0, allowed] = -7.5
        assert_as_topk(scores)


@pytest.mark.parametrize("others", SHOWN_WITH)
def test_a_nan_is_ranked_as_topk_ranks_it(others):
    scores = torch.randn(1 + others, 8008).log_softmax(dim=-1)
    scores[0, 100] = torch.nan
    values, indices = top_token(scores)
    assert int(indices[0]) == 100 and torch.isnan(values[0]).item()
    assert torch.equal(indices, scores.topk(1, dim=-1).indices)


def test_a_block_divides_the_vocabulary_where_it_can():
    assert 8008 % block_size(8008) == 0 and 64 <= block_size(8008) <= 160
    assert block_size(32000) == 160
    assert block_size(8009) == 128  # a prime: the last block short
