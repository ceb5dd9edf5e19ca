"""Runs the CUDA kernels of ``kernels/*.cu`` on the CPU, for tests without a GPU.

A kernel file is compiled unchanged by g++ together with
``kernels/emu/cuda_emu.h``, which emulates the CUDA execution model with real
threads, a real ``__syncthreads()`` barrier, real atomics and dynamic shared
memory (see the header for the details). A small generated launcher exports
every ``extern "C" __global__`` kernel of the file.

The shared library is cached in a folder (``$FAIRSEQ_FASTGEN_EMU_CACHE`` or
``<tmp>/fairseq_fastgen_cuda_emu``) under a hash of everything it is built
from, and loaded once per process.

``launch(kernel_name, grid, block, shared_bytes, *args)`` takes the same
arguments as the CuPy launcher (``_cupy.launcher``), with CPU tensors or numpy
arrays for pointer parameters. It is stricter than CuPy: scalars must be numpy
scalars of the parameter's exact C type and pointer arguments must have the
pointee's element size, so mistakes that would pass garbage to a GPU kernel
fail here.
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import torch

from fairseq_fastgen.ops._cupy import KERNEL_DIRS, SHARED_MEMORY_LIMIT_BYTES, Launch, kernel_source_path

COMPILER = "g++"
COMPILE_FLAGS = (
    "-std=c++20",
    "-O1",
    "-pthread",
    "-fPIC",
    "-shared",
    "-Wall",
    # Turns a block-scope (non-extern) __shared__ array into an error, see cuda_emu.h.
    "-Werror=attributes",
    f"-DCUDA_EMU_SHARED_MEMORY_BYTES={SHARED_MEMORY_LIMIT_BYTES}",
)

# How the threads of a block are scheduled (see cuda_emu.h).
SCHEDULES = ("concurrent", "sequential")

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)\s*\('
)
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+([^;\[\]]+?)\s+(\w+)\s*\[\s*\]\s*;")
_ALIGNMENT = re.compile(r"(?:__align__|alignas)\s*\([^)]*\)")

Dims = Union[int, Sequence[int]]


class EmulatorBuildError(RuntimeError):
    """g++ failed to build the emulation library of a kernel file."""


def compiler_available() -> bool:
    """True when g++ is on PATH."""
    return shutil.which(COMPILER) is not None


def emulation_header() -> Path:
    """Path of ``emu/cuda_emu.h`` next to the kernel sources."""
    for folder in KERNEL_DIRS:
        candidate = folder / "emu" / "cuda_emu.h"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"emu/cuda_emu.h not found in {', '.join(map(str, KERNEL_DIRS))}")


def cache_dir() -> Path:
    configured = os.environ.get("FAIRSEQ_FASTGEN_EMU_CACHE")
    folder = Path(configured) if configured else Path(tempfile.gettempdir()) / "fairseq_fastgen_cuda_emu"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _preprocessed(source: Path) -> str:
    """The kernel source after the preprocessor (macros that define kernels
    expanded), without the emulation header."""
    result = subprocess.run(
        [COMPILER, "-std=c++20", "-E", "-P", "-x", "c++", str(source)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise EmulatorBuildError(f"preprocessing {source} failed:\n{result.stderr}")
    return result.stdout


def _launcher_source(header: Path, source: Path, kernel_names: List[str]) -> str:
    exports = "".join(f"CUDA_EMU_EXPORT({name})\n" for name in kernel_names)
    return f'#include "{header}"\n#include "{source}"\n\n{exports}'


def _shared_memory_source(shared_arrays: List[Tuple[str, str]]) -> str:
    """Defines the dynamic shared memory buffer and makes every
    ``extern __shared__ TYPE NAME[]`` of the kernel file an alias of it."""
    lines = ["alignas(16) unsigned char cuda_emu_dynamic_shared[CUDA_EMU_SHARED_MEMORY_BYTES];"]
    for element_type, name in sorted(set(shared_arrays)):
        lines.append(
            f"extern {element_type} {name}[CUDA_EMU_SHARED_MEMORY_BYTES / sizeof({element_type})]"
            ' __attribute__((alias("cuda_emu_dynamic_shared")));'
        )
    return "\n".join(lines) + "\n"


def _compiler_version() -> str:
    return subprocess.run([COMPILER, "--version"], capture_output=True, text=True).stdout


def _build(source: Path) -> Tuple[Path, List[str]]:
    """Compiles (or finds in the cache) the emulation library of a kernel
    source; returns its path and the kernel names."""
    preprocessed = _preprocessed(source)
    kernel_names = _KERNEL.findall(preprocessed)
    shared_arrays = [
        (" ".join(_ALIGNMENT.sub("", element_type).split()), array_name)
        for element_type, array_name in _DYNAMIC_SHARED.findall(preprocessed)
    ]
    header = emulation_header()
    sources = {
        f"{source.stem}_launcher.cpp": _launcher_source(header, source, kernel_names),
        f"{source.stem}_shared_memory.cpp": _shared_memory_source(shared_arrays),
    }
    digest = hashlib.sha256()
    for part in (header.read_text(), source.read_text(), *sources.values(), " ".join(COMPILE_FLAGS),
                 _compiler_version()):
        digest.update(part.encode() + b"\0")
    library = cache_dir() / f"{source.stem}-{digest.hexdigest()[:20]}.so"
    if not library.is_file():
        _compile(sources, library, source)
    return library, kernel_names


def _compile(sources: Dict[str, str], library: Path, kernel_source: Path) -> None:
    """Compiles the generated C++ files ``sources`` (name -> text) into
    ``library``, which appears atomically (concurrent test workers never see
    half a file)."""
    with tempfile.TemporaryDirectory(dir=library.parent) as work_dir:
        paths = []
        for file_name, text in sources.items():
            paths.append(Path(work_dir) / file_name)
            paths[-1].write_text(text)
        built = Path(work_dir) / library.name
        command = [COMPILER, *COMPILE_FLAGS, *map(str, paths), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            hint = ""
            if "visibility" in result.stderr:
                hint = (
                    "\nhint: the emulator supports __shared__ variables at namespace scope and"
                    " extern __shared__ arrays, not __shared__ arrays inside functions."
                )
            raise EmulatorBuildError(
                f"building the emulation of {kernel_source} failed:\n"
                f"{' '.join(command)}\n{result.stderr}{hint}"
            )
        os.replace(built, library)


def _dims(value: Dims) -> "ctypes.Array":
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"grid and block need 1 to 3 dimensions, got {value!r}")
    return (ctypes.c_uint * 3)(*(dims + [1] * (3 - len(dims))))


def _pointer_argument(arg, code: str, position: int) -> ctypes.c_void_p:
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise TypeError(f"argument {position}: the emulator needs CPU tensors, got {arg.device}")
        address, itemsize = arg.data_ptr(), arg.element_size()
    elif isinstance(arg, np.ndarray):
        address, itemsize = arg.ctypes.data, arg.itemsize
    else:
        raise TypeError(f"argument {position}: expected a tensor or array for a pointer, got {type(arg)}")
    pointee_size = int(code[len("pointer"):])
    if pointee_size and itemsize != pointee_size:
        raise TypeError(
            f"argument {position}: elements of {itemsize} bytes for a pointer to {pointee_size}-byte values"
        )
    return ctypes.c_void_p(address)


def _scalar_argument(arg, code: str, position: int) -> np.ndarray:
    if code == "unsupported":
        raise TypeError(f"argument {position}: the emulator passes only pointers and arithmetic scalars")
    if not isinstance(arg, np.generic) or arg.dtype != np.dtype(code):
        raise TypeError(f"argument {position}: the kernel takes {code}; pass np.{code}(...), got {arg!r}")
    return np.array([arg], dtype=code)


class EmulatedModule:
    """The emulated kernels of one kernel file."""

    def __init__(self, library: Path, kernel_names: List[str]):
        self._library = ctypes.CDLL(str(library))
        self.kernel_names = tuple(kernel_names)
        self._signatures: Dict[str, List[str]] = {}
        for kernel_name in kernel_names:
            signature = getattr(self._library, f"cuda_emu_signature__{kernel_name}")
            signature.restype = ctypes.c_char_p
            codes = signature().decode()
            self._signatures[kernel_name] = codes.split(",") if codes else []
            entry = getattr(self._library, f"cuda_emu_launch__{kernel_name}")
            entry.restype = ctypes.c_int
            entry.argtypes = [
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_char_p,
                ctypes.c_size_t,
            ]

    def launch(self, kernel_name: str, grid: Dims, block: Dims, shared_bytes: int, *args,
               schedule: str = "concurrent") -> None:
        """Runs ``kernel_name<<<grid, block, shared_bytes>>>(*args)`` and waits
        for it. Raises ValueError/TypeError for bad arguments and RuntimeError
        for a launch configuration a GPU would reject."""
        if kernel_name not in self._signatures:
            raise ValueError(f"no kernel {kernel_name!r}; the file has {', '.join(self.kernel_names)}")
        codes = self._signatures[kernel_name]
        if len(args) != len(codes):
            raise TypeError(f"{kernel_name} takes {len(codes)} arguments, got {len(args)}")
        values = [
            _pointer_argument(arg, code, position) if code.startswith("pointer")
            else _scalar_argument(arg, code, position)
            for position, (arg, code) in enumerate(zip(args, codes))
        ]
        addresses = [
            ctypes.addressof(value) if isinstance(value, ctypes.c_void_p) else value.ctypes.data
            for value in values
        ]
        arg_pointers = (ctypes.c_void_p * max(1, len(addresses)))(*addresses)
        error = ctypes.create_string_buffer(512)
        entry = getattr(self._library, f"cuda_emu_launch__{kernel_name}")
        status = entry(_dims(grid), _dims(block), shared_bytes, SCHEDULES.index(schedule),
                       arg_pointers, error, len(error))
        if status != 0:
            raise RuntimeError(f"{kernel_name}: {error.value.decode()}")


@functools.lru_cache(maxsize=None)
def load_file(source: Path) -> EmulatedModule:
    """The emulation of the kernels in the CUDA source file ``source``, built
    at most once per process."""
    library, kernel_names = _build(Path(source).resolve())
    return EmulatedModule(library, kernel_names)


def load(name: str) -> EmulatedModule:
    """The emulation of ``kernels/<name>.cu``."""
    return load_file(kernel_source_path(name))


def launcher(name: str, schedule: str = "concurrent") -> Launch:
    """``launch(kernel_name, grid, block, shared_bytes, *args)`` for the
    emulated kernels of ``kernels/<name>.cu``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    module = load(name)
    return functools.partial(module.launch, schedule=schedule)
