"""reorder_beam_cache / shrink_shared_cache: torch references == plain Python,
kernel (emulated on the CPU, and on a GPU when there is one) == references."""

import pytest
import torch

from fairseq_fastgen.ops import _cupy, _emulator
from fairseq_fastgen.ops.cache_reorder import (
    KERNEL_FILE,
    gather_rows_with_kernel,
    reorder_beam_cache,
    reorder_beam_cache_reference,
    shrink_shared_cache,
    shrink_shared_cache_reference,
)

needs_compiler = pytest.mark.skipif(not _emulator.compiler_available(), reason="no g++ for the emulation")
needs_gpu = pytest.mark.skipif(not _cupy.gpu_available(), reason="needs a CUDA device and CuPy")


def gather_plain(cache, source_rows):
    """Plain-Python reference: the list of rows ``[cache[s] for s in source_rows]``."""
    rows = cache.tolist()
    return torch.tensor([rows[source] for source in source_rows.tolist()], dtype=cache.dtype)


def random_cache(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).mul(100).to(dtype)


def beam_orders(rows, beam, seed):
    """New orders as beam search makes them: every row continues a beam of
    its own sentence; plus the identity, a cycle and all-from-one-row."""
    generator = torch.Generator().manual_seed(seed)
    sentence_start = torch.arange(rows) // beam * beam
    return {
        "beam": sentence_start + torch.randint(0, beam, (rows,), generator=generator),
        "identity": torch.arange(rows),
        "cycle": torch.roll(torch.arange(rows), 1),
        "permutation": torch.randperm(rows, generator=generator),
        "all-from-last": torch.full((rows,), rows - 1),
    }


@pytest.mark.parametrize("order_name", ["beam", "identity", "cycle", "permutation", "all-from-last"])
def test_reorder_reference_equals_plain_python(order_name):
    cache = random_cache((12, 2, 5, 4), torch.float32, seed=1)
    new_order = beam_orders(12, beam=4, seed=1)[order_name]
    expected = gather_plain(cache, new_order)
    result = reorder_beam_cache_reference(cache, new_order)
    assert result is cache
    assert torch.equal(result, expected)


def test_shrink_reference_equals_plain_python():
    cache = random_cache((6, 1, 7, 4), torch.float32, seed=2)
    keep = torch.tensor([5, 0, 3])
    assert torch.equal(shrink_shared_cache_reference(cache, keep), gather_plain(cache, keep))


def test_entry_points_on_cpu():
    cache = random_cache((4, 2, 3, 2), torch.float32, seed=3)
    original = cache.clone()
    assert reorder_beam_cache(cache, torch.tensor([1, 1, 3, 0])) is cache
    assert torch.equal(cache, original[[1, 1, 3, 0]])
    assert torch.equal(shrink_shared_cache(cache, torch.tensor([2])), original[[3]])


@pytest.mark.parametrize(
    "cache, order",
    [
        (torch.zeros(3, 2), torch.tensor([0, 1])),  # wrong length
        (torch.zeros(3, 2), torch.tensor([[0, 1, 2]])),  # not 1-D
        (torch.zeros(3, 2), torch.tensor([0, 1, 2], dtype=torch.int32)),  # not int64
    ],
)
def test_reorder_rejects_bad_orders(cache, order):
    with pytest.raises(ValueError):
        reorder_beam_cache(cache, order)


def test_shrink_rejects_keeping_more_than_all():
    with pytest.raises(ValueError):
        shrink_shared_cache(torch.zeros(2, 3), torch.tensor([0, 1, 1]))


@pytest.fixture(scope="module", params=_emulator.SCHEDULES)
def emulated(request):  # tests using it are marked needs_compiler
    return _emulator.launcher(KERNEL_FILE, schedule=request.param)


# (shape, dtype): rows of 4-byte, 2-byte and 1-byte words.
CACHE_LAYOUTS = [
    ((10, 2, 6, 4), torch.float32),
    ((10, 3, 5, 3), torch.float16),
    ((10, 1, 7, 3), torch.uint8),
    ((10, 2, 3, 2), torch.float64),
]


@needs_compiler
@pytest.mark.parametrize("shape, dtype", CACHE_LAYOUTS)
@pytest.mark.parametrize("order_name", ["beam", "identity", "cycle", "permutation", "all-from-last"])
def test_emulated_reorder_in_place(emulated, shape, dtype, order_name):
    cache = random_cache(shape, dtype, seed=4)
    new_order = beam_orders(shape[0], beam=5, seed=4)[order_name]
    expected = reorder_beam_cache_reference(cache.clone(), new_order)
    storage = cache.data_ptr()
    result = gather_rows_with_kernel(cache, new_order, emulated)
    assert result.data_ptr() == storage
    assert torch.equal(result, expected)


@needs_compiler
@pytest.mark.parametrize("tile_words, threads", [(1, 32), (5, 32), (7, 3), (1000, 64)])
def test_emulated_reorder_tiles_and_blocks(emulated, tile_words, threads):
    """Tiles that do not divide the row, one-word tiles, blocks smaller than
    the staged tile, and one tile covering the whole row."""
    cache = random_cache((10, 2, 6, 4), torch.float32, seed=5)
    new_order = beam_orders(10, beam=5, seed=5)["beam"]
    expected = reorder_beam_cache_reference(cache.clone(), new_order)
    gather_rows_with_kernel(cache, new_order, emulated, tile_words=tile_words, threads_per_block=threads)
    assert torch.equal(cache, expected)


@needs_compiler
def test_emulated_reorder_one_row(emulated):
    cache = random_cache((1, 2, 3, 4), torch.float32, seed=6)
    expected = cache.clone()
    gather_rows_with_kernel(cache, torch.tensor([0]), emulated)
    assert torch.equal(cache, expected)


@needs_compiler
@pytest.mark.parametrize("keep", [[0, 1, 2, 3, 4, 5], [1, 3, 4], [5], [4, 0, 2], [5, 4, 3, 2, 1, 0]])
@pytest.mark.parametrize("shape", [(6, 1, 9, 4), (6, 2, 9, 4)])
def test_emulated_shrink(emulated, keep, shape):
    cache = random_cache(shape, torch.float16, seed=7)
    keep = torch.tensor(keep)
    expected = shrink_shared_cache_reference(cache, keep)
    result = gather_rows_with_kernel(cache, keep, emulated, tile_words=7)[: keep.numel()]
    assert result.data_ptr() == cache.data_ptr()
    assert torch.equal(result, expected)


@needs_compiler
def test_emulated_shrink_to_nothing_moves_nothing(emulated):
    cache = random_cache((3, 1, 2, 2), torch.float32, seed=8)
    expected = cache.clone()
    assert gather_rows_with_kernel(cache, torch.tensor([], dtype=torch.long), emulated) is cache
    assert torch.equal(cache, expected)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("order_name", ["beam", "identity", "cycle", "permutation", "all-from-last"])
def test_gpu_reorder_equals_reference(dtype, order_name):
    cache = random_cache((8 * 5, 4, 33, 16), dtype, seed=9)
    new_order = beam_orders(8 * 5, beam=5, seed=9)[order_name]
    expected = reorder_beam_cache_reference(cache.clone(), new_order)
    gpu_cache = cache.cuda()
    result = reorder_beam_cache(gpu_cache, new_order.cuda())
    assert result.data_ptr() == gpu_cache.data_ptr()
    assert torch.equal(result.cpu(), expected)


@needs_gpu
@pytest.mark.parametrize("keep", [[0, 2, 3, 7], [7], [6, 1, 0]])
def test_gpu_shrink_equals_reference(keep):
    cache = random_cache((8, 1, 21, 16), torch.float16, seed=10)
    keep = torch.tensor(keep)
    expected = shrink_shared_cache_reference(cache, keep)
    result = shrink_shared_cache(cache.cuda(), keep.cuda())
    assert torch.equal(result.cpu(), expected)
