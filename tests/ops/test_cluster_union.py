"""cluster_union_mask: torch reference == plain Python, kernels (emulated on
the CPU, and on a GPU when there is one) == torch reference."""

import pytest
import torch

from fairseq_fastgen.ops import _cupy, _emulator
from fairseq_fastgen.ops.cluster_union import (
    KERNEL_FILE,
    ClusterActiveSets,
    cluster_union_mask,
    cluster_union_mask_reference,
    cluster_union_mask_with_kernel,
)

needs_compiler = pytest.mark.skipif(not _emulator.compiler_available(), reason="no g++ for the emulation")
needs_gpu = pytest.mark.skipif(not _cupy.gpu_available(), reason="needs a CUDA device and CuPy")


def union_plain(chosen_clusters, token_lists, vocab_size):
    """Plain-Python reference: (mask as a list of bools, sorted columns)."""
    active = set()
    for cluster in chosen_clusters:
        active.update(token_lists[cluster])
    return [token in active for token in range(vocab_size)], sorted(active)


def union_case(choice, vocab_size, clusters, states, most_active, seed):
    """(chosen clusters, one active token list per cluster) for a choice
    pattern: random, all the same, all different, one state or none. Some
    clusters have no active token."""
    generator = torch.Generator().manual_seed(seed)
    token_lists = []
    for _ in range(clusters):
        size = int(torch.randint(0, most_active + 1, (1,), generator=generator))
        token_lists.append(torch.randperm(vocab_size, generator=generator)[:size].tolist())
    chosen = {
        "random": lambda: torch.randint(0, clusters, (states,), generator=generator),
        "all-same": lambda: torch.full((states,), clusters // 2),
        "all-different": lambda: torch.randperm(clusters, generator=generator)[: min(states, clusters)],
        "one-state": lambda: torch.tensor([clusters - 1]),
        "no-state": lambda: torch.tensor([], dtype=torch.long),
    }[choice]()
    return chosen, token_lists


CHOICES = ["random", "all-same", "all-different", "one-state", "no-state"]


@pytest.mark.parametrize("choice", CHOICES)
def test_reference_equals_plain_python(choice):
    vocab_size = 300
    chosen, token_lists = union_case(choice, vocab_size, clusters=20, states=12, most_active=40, seed=1)
    active_sets = ClusterActiveSets.from_lists(token_lists)
    mask, columns = cluster_union_mask_reference(chosen, active_sets, vocab_size)
    expected_mask, expected_columns = union_plain(chosen.tolist(), token_lists, vocab_size)
    assert mask.dtype == torch.bool and columns.dtype == torch.long
    assert mask.tolist() == expected_mask
    assert columns.tolist() == expected_columns


def test_entry_point_on_cpu():
    active_sets = ClusterActiveSets.from_lists([[4, 1], [], [2, 4, 0]])
    mask, columns = cluster_union_mask(torch.tensor([2, 0, 2]), active_sets, vocab_size=6)
    assert mask.tolist() == [True, True, True, False, True, False]
    assert columns.tolist() == [0, 1, 2, 4]


def test_entry_point_rejects_bad_arguments():
    active_sets = ClusterActiveSets.from_lists([[1]])
    with pytest.raises(ValueError):
        cluster_union_mask(torch.tensor([0], dtype=torch.int32), active_sets, vocab_size=3)


@pytest.fixture(scope="module", params=_emulator.SCHEDULES)
def emulated(request):  # tests using it are marked needs_compiler
    return _emulator.launcher(KERNEL_FILE, schedule=request.param)


def assert_kernels_match_reference(launch, chosen, token_lists, vocab_size, **launch_shape):
    active_sets = ClusterActiveSets.from_lists(token_lists)
    expected_mask, expected_columns = cluster_union_mask_reference(chosen, active_sets, vocab_size)
    mask, columns = cluster_union_mask_with_kernel(chosen, active_sets, vocab_size, launch, **launch_shape)
    assert torch.equal(mask, expected_mask)
    assert torch.equal(columns, expected_columns)


@needs_compiler
@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize(
    "launch_shape",
    [{}, {"threads_per_block": 32, "most_marking_blocks": 3}, {"threads_per_block": 7}],
    ids=["default", "small-blocks", "odd-block"],
)
def test_emulated_kernels(emulated, choice, launch_shape):
    """Vocabularies of several tiles with a partial last tile, grid-stride
    marking, and a block size that is not a power of two."""
    vocab_size = 1000
    chosen, token_lists = union_case(choice, vocab_size, clusters=30, states=50, most_active=120, seed=2)
    assert_kernels_match_reference(emulated, chosen, token_lists, vocab_size, **launch_shape)


@needs_compiler
def test_emulated_kernels_whole_and_empty_vocabulary(emulated):
    vocab_size = 257
    token_lists = [list(range(vocab_size)), [], [0, vocab_size - 1]]
    for chosen in ([0], [1], [2], [1, 2]):
        chosen = torch.tensor(chosen)
        assert_kernels_match_reference(emulated, chosen, token_lists, vocab_size, threads_per_block=32)


@needs_gpu
@pytest.mark.parametrize("choice", CHOICES)
def test_gpu_entry_point_equals_reference(choice):
    vocab_size = 50_000
    chosen, token_lists = union_case(choice, vocab_size, clusters=64, states=200, most_active=3000, seed=3)
    expected = cluster_union_mask_reference(chosen, ClusterActiveSets.from_lists(token_lists), vocab_size)
    gpu_active_sets = ClusterActiveSets.from_lists(token_lists, device="cuda")
    mask, columns = cluster_union_mask(chosen.cuda(), gpu_active_sets, vocab_size)
    assert mask.is_cuda and columns.is_cuda
    assert torch.equal(mask.cpu(), expected[0])
    assert torch.equal(columns.cpu(), expected[1])
