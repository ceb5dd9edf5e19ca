"""ban_repeated_ngrams: torch reference == plain Python, kernel (emulated on
the CPU, and on a GPU when there is one) == torch reference."""

import pytest
import torch

from fairseq_fastgen.ops import _cupy, _emulator
from fairseq_fastgen.ops.ngram_ban import (
    KERNEL_FILE,
    ban_repeated_ngrams,
    ban_repeated_ngrams_reference,
    ban_repeated_ngrams_with_kernel,
)

NGRAM_SIZES = (1, 2, 3, 4)
PAD = 1

needs_compiler = pytest.mark.skipif(not _emulator.compiler_available(), reason="no g++ for the emulation")
needs_gpu = pytest.mark.skipif(not _cupy.gpu_available(), reason="needs a CUDA device and CuPy")


def banned_plain(row_tokens, step, n):
    """Plain-Python reference: the tokens banned for one row."""
    generated = list(row_tokens[: step + 1])
    suffix = generated[len(generated) - (n - 1):]
    banned = set()
    for start in range(len(generated) - n + 1):
        if generated[start:start + n - 1] == suffix:
            banned.add(generated[start + n - 1])
    return banned


def ban_plain(tokens, lprobs, step, n):
    expected = lprobs.clone()
    for row, row_tokens in enumerate(tokens.tolist()):
        for token in banned_plain(row_tokens, step, n):
            expected[row, token] = float("-inf")
    return expected


def generator_buffer(rows, max_len, vocab, seed):
    """A token buffer shaped like fairseq's (rows, max_len + 2) of random
    tokens of a small vocabulary (many repeats), and lprobs (rows, vocab)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, max_len + 2), generator=generator)
    lprobs = torch.randn(rows, vocab, generator=generator).log_softmax(-1)
    return tokens, lprobs


def periodic_buffer(max_len, vocab):
    """Rows of period 1 (one token repeated), 2 and 3: every n-gram size
    matches at the last possible start, where off-by-one bounds go wrong."""
    positions = torch.arange(max_len + 2)
    tokens = torch.stack([torch.zeros_like(positions), positions % 2, positions % 3 + 1])
    return tokens, torch.zeros(3, vocab)


def at_step(tokens, step, padded):
    """The buffer at ``step``: the tail after it is pad, or left as random
    garbage; it must be ignored either way."""
    if not padded:
        return tokens
    tokens = tokens.clone()
    tokens[:, step + 1:] = PAD
    return tokens


@pytest.mark.parametrize("periodic", [False, True], ids=["random", "periodic"])
@pytest.mark.parametrize("padded", [True, False], ids=["pad-tail", "garbage-tail"])
@pytest.mark.parametrize("n", NGRAM_SIZES)
def test_reference_equals_plain_python_at_every_step(n, padded, periodic):
    max_len = 16
    if periodic:
        tokens, lprobs = periodic_buffer(max_len, vocab=5)
    else:
        tokens, lprobs = generator_buffer(rows=2 * 4, max_len=max_len, vocab=5, seed=n)
    for step in range(max_len + 1):
        buffer = at_step(tokens, step, padded)
        expected = ban_plain(buffer, lprobs, step, n)
        actual = ban_repeated_ngrams_reference(buffer, lprobs.clone(), step, n)
        assert torch.equal(actual, expected), f"step {step}"


def test_plain_python_reference_on_a_known_row():
    row = [7, 3, 4, 7, 3, 5, 7, 3]
    assert banned_plain(row, step=7, n=3) == {4, 5}
    assert banned_plain(row, step=7, n=2) == {4, 5}
    assert banned_plain(row, step=6, n=2) == {3}
    assert banned_plain(row, step=7, n=1) == {3, 4, 5, 7}
    assert banned_plain(row, step=1, n=3) == set()  # fewer than n tokens generated


def test_entry_point_on_cpu_bans_in_place():
    tokens = torch.tensor([[7, 3, 4, 7, 3, PAD, PAD]])
    lprobs = torch.zeros(1, 8)
    result = ban_repeated_ngrams(tokens, lprobs, step=4, n=3)
    assert result is lprobs
    assert lprobs[0].tolist() == [0, 0, 0, 0, float("-inf"), 0, 0, 0]


@pytest.mark.parametrize(
    "tokens, lprobs, step, n",
    [
        (torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 4), 1, 2),  # row counts differ
        (torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, 4), 1, 2),  # tokens not int64
        (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4), 5, 2),  # step past the buffer
        (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4), 1, 0),  # n < 1
    ],
)
def test_entry_point_rejects_bad_arguments(tokens, lprobs, step, n):
    with pytest.raises(ValueError):
        ban_repeated_ngrams(tokens, lprobs, step, n)


@pytest.fixture(scope="module", params=_emulator.SCHEDULES)
def emulated(request):  # tests using it are marked needs_compiler
    return _emulator.launcher(KERNEL_FILE, schedule=request.param)


def assert_kernel_matches_reference(launch, tokens, lprobs, step, n, threads_per_block=None):
    expected = ban_repeated_ngrams_reference(tokens, lprobs.clone(), step, n)
    actual = ban_repeated_ngrams_with_kernel(tokens, lprobs.clone(), step, n, launch, threads_per_block)
    assert torch.equal(actual, expected), f"step {step}, n {n}"


@needs_compiler
@pytest.mark.parametrize("n", NGRAM_SIZES)
def test_emulated_kernel_at_every_step(emulated, n):
    max_len = 12
    tokens, lprobs = generator_buffer(rows=3 * 2, max_len=max_len, vocab=4, seed=10 + n)
    for step in range(max_len + 1):  # includes steps where n exceeds the generated length
        assert_kernel_matches_reference(emulated, at_step(tokens, step, padded=True), lprobs, step, n)


@needs_compiler
@pytest.mark.parametrize("n", NGRAM_SIZES)
def test_emulated_kernel_on_periodic_rows(emulated, n):
    max_len = 12
    tokens, lprobs = periodic_buffer(max_len, vocab=5)
    for step in range(max_len + 1):
        assert_kernel_matches_reference(emulated, at_step(tokens, step, padded=True), lprobs, step, n)


@needs_compiler
@pytest.mark.parametrize("n", NGRAM_SIZES)
def test_emulated_kernel_rows_longer_than_the_block(emulated, n):
    max_len = 200
    random_tokens, random_lprobs = generator_buffer(rows=3, max_len=max_len, vocab=4, seed=20 + n)
    periodic_tokens, periodic_lprobs = periodic_buffer(max_len, vocab=4)
    tokens = torch.cat([random_tokens, periodic_tokens])  # (6, max_len + 2)
    lprobs = torch.cat([random_lprobs, periodic_lprobs])  # (6, 4)
    for step in (31, 32, 33, 150, max_len):
        assert_kernel_matches_reference(emulated, tokens, lprobs, step, n, threads_per_block=32)


@needs_compiler
def test_emulated_kernel_one_row_and_one_thread(emulated):
    tokens, lprobs = generator_buffer(rows=1, max_len=40, vocab=3, seed=3)
    for n in NGRAM_SIZES:
        assert_kernel_matches_reference(emulated, tokens, lprobs, step=40, n=n, threads_per_block=1)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_emulated_kernel_other_dtypes(emulated, dtype):
    tokens, lprobs = generator_buffer(rows=4, max_len=30, vocab=5, seed=4)
    for n in NGRAM_SIZES:
        assert_kernel_matches_reference(emulated, tokens, lprobs.to(dtype), step=30, n=n)


@needs_compiler
def test_emulated_kernel_strided_inputs(emulated):
    tokens, lprobs = generator_buffer(rows=4, max_len=30, vocab=6, seed=5)
    wide_tokens = torch.cat([tokens, tokens], dim=1)[:, : tokens.size(1)]  # row stride != buffer_len
    wide_lprobs = torch.cat([lprobs, lprobs], dim=1)
    for n in NGRAM_SIZES:
        assert_kernel_matches_reference(emulated, wide_tokens, wide_lprobs[:, :6], step=30, n=n)
        assert_kernel_matches_reference(emulated, tokens, lprobs.t().contiguous().t(), step=30, n=n)


@needs_gpu
@pytest.mark.parametrize("n", NGRAM_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_entry_point_equals_reference(n, dtype):
    max_len = 200
    tokens, lprobs = generator_buffer(rows=8 * 5, max_len=max_len, vocab=6, seed=30 + n)
    for step in range(0, max_len + 1, 7):
        buffer = at_step(tokens, step, padded=True)
        expected = ban_repeated_ngrams_reference(buffer, lprobs.to(dtype), step, n)
        gpu_lprobs = lprobs.to(dtype).cuda()
        actual = ban_repeated_ngrams(buffer.cuda(), gpu_lprobs, step, n)
        assert actual.data_ptr() == gpu_lprobs.data_ptr()
        assert torch.equal(actual.cpu(), expected), f"step {step}"
