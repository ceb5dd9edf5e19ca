"""Loading and launching the CUDA kernels in ``kernels/*.cu`` through CuPy.

CuPy is imported lazily: importing this module (and every op module) works
without CuPy, and the ops fall back to their torch references then.

A kernel file is compiled once per device (``cupy.RawModule``, kept in a
process-wide cache). Launches run on torch's current CUDA stream and take
torch tensors zero-copy through DLPack.

Every op builds its launch as ``launch(kernel_name, grid, block,
shared_bytes, *args)``, the same call the CPU emulator (``_emulator.py``)
accepts, so the argument packing is tested without a GPU. Scalars are passed
as numpy scalars of the exact C type of the kernel parameter.
"""

import functools
import importlib
import threading
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

# Dynamic shared memory a kernel may use without opting in to more: the
# default limit of every GPU since compute capability 3.0. The emulator
# enforces the same limit.
SHARED_MEMORY_LIMIT_BYTES = 48 * 1024

# The most threads per block on every supported GPU.
MAX_THREADS_PER_BLOCK = 1024

# Candidate folders for the kernel sources, in lookup order: inside the
# installed package (setup.py copies them there), then the checkout's root.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
KERNEL_DIRS = (_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels")

Launch = Callable[..., None]


def kernel_source_path(name: str) -> Path:
    """Path of the CUDA source ``<name>.cu`` (``name`` without the suffix).

    Raises FileNotFoundError naming the folders searched when it is missing.
    """
    file_name = f"{name}.cu"
    for folder in KERNEL_DIRS:
        candidate = folder / file_name
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(folder) for folder in KERNEL_DIRS)
    raise FileNotFoundError(f"kernel source {file_name} not found in {searched}")


@functools.lru_cache(maxsize=None)
def cupy_module():
    """The ``cupy`` module, or None when it is not installed."""
    try:
        return importlib.import_module("cupy")
    except ImportError:
        return None


def is_available() -> bool:
    """True when CuPy can be imported (a GPU is still needed to launch)."""
    return cupy_module() is not None


def gpu_available() -> bool:
    """True when CuPy is installed and torch sees a CUDA device."""
    return is_available() and torch.cuda.is_available()


def threads_for(work_items: int, most: int = 256) -> int:
    """A block size for ``work_items`` parallel items: a multiple of the warp
    size (32), at least one warp and at most ``most`` threads."""
    warps = max(1, -(-work_items // 32))
    return min(most, warps * 32)


_modules_lock = threading.Lock()
_modules: Dict[Tuple[str, int], object] = {}


def _compiled_module(name: str, device_index: int):
    """The RawModule of kernel file ``name`` for one device, compiled once."""
    key = (name, device_index)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            cupy = cupy_module()
            source = kernel_source_path(name).read_text()
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=source)
            _modules[key] = module
        return module


def _device_index(args) -> int:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.index
    raise ValueError("a kernel launch needs at least one CUDA tensor argument")


def _as_kernel_argument(arg):
    """Torch CUDA tensors become CuPy arrays on the same memory (zero-copy);
    numpy scalars pass through unchanged."""
    if isinstance(arg, torch.Tensor):
        if not arg.is_cuda:
            raise ValueError("CuPy kernels need CUDA tensors")
        return cupy_module().from_dlpack(arg)
    return arg


@functools.lru_cache(maxsize=None)
def launcher(name: str) -> Launch:
    """``launch(kernel_name, grid, block, shared_bytes, *args)`` for the
    kernels of ``kernels/<name>.cu``, running on torch's current stream of
    the device of the first tensor argument."""
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("CuPy is not installed")

    def launch(kernel_name: str, grid, block, shared_bytes: int, *args) -> None:
        device_index = _device_index(args)
        kernel = _compiled_module(name, device_index).get_function(kernel_name)
        stream = torch.cuda.current_stream(device_index)
        with cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(stream.cuda_stream):
            kernel_args = tuple(_as_kernel_argument(arg) for arg in args)
            kernel(tuple(grid), tuple(block), kernel_args, shared_mem=shared_bytes)

    return launch


def launcher_for(tensor: torch.Tensor, name: str) -> Optional[Launch]:
    """The CuPy launcher of ``kernels/<name>.cu`` when ``tensor`` lives on a
    CUDA device and CuPy is installed; None otherwise (use the reference)."""
    if tensor.is_cuda and is_available():
        return launcher(name)
    return None
