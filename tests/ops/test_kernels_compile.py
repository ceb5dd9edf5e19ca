"""The CUDA sources compile with nvcc for the GPUs we target, and the CPU
emulation that the op tests run them under behaves like CUDA."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from fairseq_fastgen.ops import _emulator
from fairseq_fastgen.ops._cupy import SHARED_MEMORY_LIMIT_BYTES, kernel_source_path

KERNEL_DIR = kernel_source_path("ngram_ban").parent
SELFTEST_SOURCE = KERNEL_DIR / "emu" / "selftest.cu"
CUDA_SOURCES = sorted(KERNEL_DIR.glob("*.cu")) + [SELFTEST_SOURCE]
ARCHITECTURES = ("sm_80", "sm_90")


def test_the_op_kernels_are_there():
    assert {path.stem for path in KERNEL_DIR.glob("*.cu")} >= {"ngram_ban", "cache_reorder", "cluster_union"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda path: path.name)
def test_compiles_with_nvcc(source, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: the CUDA sources were not compiled")
    command = [nvcc, f"-arch={arch}", "--cubin", "-Werror", "all-warnings", "-o", str(tmp_path / "out.cubin"),
               str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"


# ------------------------------------------------------------ the emulation

needs_compiler = pytest.mark.skipif(not _emulator.compiler_available(), reason="no g++ for the emulation")


@pytest.fixture(scope="module")
def selftest():
    return _emulator.load_file(SELFTEST_SOURCE)


def ints(values):
    return torch.tensor(values, dtype=torch.int32)


@needs_compiler
@pytest.mark.parametrize("schedule", _emulator.SCHEDULES)
@pytest.mark.parametrize("count", [32, 20, 1])
def test_barrier_orders_shared_memory(selftest, schedule, count):
    values = ints(range(10, 10 + count))
    output = torch.zeros(count, dtype=torch.int32)
    selftest.launch("reverse_in_shared", 1, 32, 4 * count, values, output, np.int32(count), schedule=schedule)
    assert torch.equal(output, values.flip(0))


@needs_compiler
def test_missing_barrier_fails_under_the_sequential_schedule(selftest):
    values = ints(range(10, 42))
    output = torch.zeros(32, dtype=torch.int32)
    selftest.launch("reverse_in_shared_unsynchronized", 1, 32, 4 * 32, values, output, np.int32(32),
                    schedule="sequential")
    assert not torch.equal(output, values.flip(0))
    assert output[0] != values[-1]  # thread 0 read the slot of thread 31 before thread 31 wrote it


@needs_compiler
@pytest.mark.parametrize("schedule", _emulator.SCHEDULES)
def test_threads_that_returned_leave_the_barrier(selftest, schedule):
    blocks, count = 3, 20
    output = torch.zeros(blocks * count, dtype=torch.int32)
    selftest.launch("early_exit_before_barrier", blocks, 64, 4 * count, output, np.int32(count),
                    schedule=schedule)
    expected = (torch.arange(count) + 1) % count + 1
    assert torch.equal(output.view(blocks, count), expected.repeat(blocks, 1).int())


@needs_compiler
@pytest.mark.parametrize("schedule", _emulator.SCHEDULES)
def test_atomics_lose_no_update(selftest, schedule):
    counter = torch.zeros(1, dtype=torch.int64)
    selftest.launch("count_with_atomics", 4, 64, 0, counter, np.int32(200), schedule=schedule)
    assert int(counter) == 4 * 64 * 200


@needs_compiler
@pytest.mark.parametrize("schedule", _emulator.SCHEDULES)
def test_namespace_scope_shared_memory_is_per_block(selftest, schedule):
    values = torch.randint(0, 100, (5, 64), dtype=torch.int32)
    sums = torch.zeros(5, dtype=torch.int32)
    selftest.launch("sum_per_block", 5, 64, 0, values, sums, schedule=schedule)
    assert torch.equal(sums, values.sum(1, dtype=torch.int32))


@needs_compiler
def test_three_dimensional_indices(selftest):
    grid, block = (2, 3, 2), (4, 2, 3)
    output = torch.zeros(12 * 24, dtype=torch.int32)
    selftest.launch("write_indices", grid, block, 0, output)
    expected = torch.arange(12).repeat_interleave(24) * 1000 + torch.arange(24).repeat(12)
    assert torch.equal(output, expected.int())


@needs_compiler
@pytest.mark.parametrize(
    "grid, block, shared_bytes",
    [(1, 1025, 0), (0, 32, 0), (1, (32, 1, 65), 0), (1, 32, SHARED_MEMORY_LIMIT_BYTES + 1)],
    ids=["too-many-threads", "empty-grid", "block-too-deep", "too-much-shared-memory"],
)
def test_launches_a_gpu_rejects_are_rejected(selftest, grid, block, shared_bytes):
    with pytest.raises(RuntimeError, match="invalid launch configuration"):
        selftest.launch("count_with_atomics", grid, block, shared_bytes, torch.zeros(1, dtype=torch.int64),
                        np.int32(1))


@needs_compiler
@pytest.mark.parametrize(
    "args",
    [
        (torch.zeros(1, dtype=torch.int64), 1),  # Python int: CuPy would pass 8 bytes for a 4-byte int
        (torch.zeros(1, dtype=torch.int64), np.int64(1)),  # wrong width
        (torch.zeros(1, dtype=torch.int32), np.int32(1)),  # 4-byte elements for an 8-byte pointee
        (torch.zeros(1, dtype=torch.int64),),  # missing argument
    ],
)
def test_arguments_must_match_the_kernel_signature(selftest, args):
    with pytest.raises(TypeError):
        selftest.launch("count_with_atomics", 1, 1, 0, *args)


@needs_compiler
def test_shared_arrays_inside_functions_are_rejected(tmp_path):
    source = tmp_path / "block_scope_shared.cu"
    source.write_text(
        'extern "C" __global__ void per_thread_copy(int* out) {\n'
        "  __shared__ int values[32];\n"
        "  values[threadIdx.x] = 1;\n"
        "  out[threadIdx.x] = values[threadIdx.x];\n"
        "}\n"
    )
    with pytest.raises(_emulator.EmulatorBuildError, match="not __shared__ arrays inside functions"):
        _emulator.load_file(source)
