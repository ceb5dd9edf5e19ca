"""A compiled step package (AOTInductor ``.pt2``) loaded by torch's C++ loader alone.

``torch._inductor.aoti_load_package`` imports inductor, which imports dynamo: memory wasted in a
process that only loads packages compiled earlier (fairseq-generate with ``--step-engine compiled`` and a warm
package directory) and never compiles.  The C++ loader runs the same compiled code; a package it cannot read
(written by another torch) goes through inductor's loader, which says why.  Where the plugin's binding of that
loader builds (``unlocked_loader.py``), the units' calls release Python's GIL.

A package whose weights are inside its shared library (every float32 unit: the frozen, prepacked weights are
constants of the compiled code) is loaded by copying them out of the library's read-only data into memory the
unit owns; the library's pages stay mapped, so each unit's weights would count twice in the process's memory (at
base size 150 MB more for a decoder step's unit, 75 MB for the encoder's). Once loaded, those pages are handed
back to the kernel (``madvise``): they are clean pages of a file, read again from it should anything touch them.

Torch's loader extracts a package into a temporary directory (``aotinductor_XXXXXX`` under ``$TMPDIR``) and removes it
only when the loader is destroyed, which a process ending with its units alive never does: every run would leave a
copy of each unit it loaded (150 MB at base size) behind.  On the CPU nothing in that directory is read after the
load (the library is mapped; a mapped file outlives its name), so it is removed at once.
"""

import ctypes
import functools
import mmap
import os
import shutil
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from fairseq_fastgen.engine.unlocked_loader import loader_class


class LoadedPackage:
    """The package's model as a callable of its positional arguments (tensors, lists of tensors, None), as when
    exported.  The engine's steps take and return tensors and flat lists of tensors: they are flattened and
    rebuilt here by hand, since pytree's walk over them is a visible share of a one-row step."""

    def __init__(self, loader):
        self.loader = loader
        self.out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
        self.out_layout = flat_layout(self.out_spec)
        self.constants = None  # the tensors a package compiled without its constants reads (keep_constants)

    def constant_names(self):
        """The names (the exported module's) of the tensors the compiled code reads as constants."""
        return self.loader.get_constant_fqns()

    def keep_constants(self, constants: dict):
        """Read ``constants`` (name -> tensor, every one of ``constant_names``) in place, and keep them."""
        self.loader.load_constants(constants, False, True, True)  # the active buffer, every name, user-managed
        self.constants = constants

    def __call__(self, *args):
        flat = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                flat.append(arg)
            elif arg is not None:
                flat.extend(arg)
        outputs = self.loader.boxed_run(flat)
        if self.out_layout is None:
            return pytree.tree_unflatten(outputs, self.out_spec)
        rebuilt, start = [], 0
        for kind, leaves in self.out_layout:
            rebuilt.append(outputs[start] if kind is None else kind(outputs[start: start + leaves]))
            start += leaves
        return tuple(rebuilt)


def flat_layout(spec):
    """[(None, 1) for a tensor, or (list or tuple, n) for a flat sequence of n tensors] for each item of the
    tuple ``spec`` describes; None for any other structure (then pytree rebuilds it)."""
    if spec.type is not tuple:
        return None
    layout = []
    for child in spec.children():
        if child.is_leaf():
            layout.append((None, 1))
        elif child.type in (list, tuple) and all(c.is_leaf() for c in child.children()):
            layout.append((child.type, child.num_leaves))
        else:
            return None
    return layout


def load_package(path: Path):
    """The callable compiled model of the package at ``path``, the library's copy of its weights released."""
    unlocked = loader_class()  # (built before the libraries are listed: the module is a library too)
    libraries_before = mapped_libraries()
    try:
        if unlocked is not None:  # its runs release the GIL (unlocked_loader.py)
            loader = unlocked(str(path))
        else:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        loaded = LoadedPackage(loader)
    except (AttributeError, RuntimeError):
        import torch._inductor as inductor

        loaded = InductorLoaded(inductor.aoti_load_package(str(path)))
    libraries = mapped_libraries() - libraries_before
    for library in libraries:
        release_constant_pages(library)
    for extracted in {extracted_directory(library) for library in libraries} - {None}:  # one per package
        shutil.rmtree(extracted, ignore_errors=True)
    return loaded


def mapped_libraries() -> set:
    """The shared libraries mapped into this process, by the names they were loaded under (also once their file is
    removed); none where /proc cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return set()
    paths = {parts[5].strip().removesuffix(" (deleted)") for parts in fields if len(parts) == 6}
    return {path for path in paths if path.endswith(".so")}


def extracted_directory(library: str) -> Optional[Path]:
    """The temporary directory torch's loader extracted ``library``'s package into (``aotinductor_XXXXXX``), or
    None where ``library`` lies elsewhere."""
    for parent in Path(library).parents:
        if parent.name.startswith("aotinductor_"):
            return parent
    return None


def constants_range(library: str) -> Optional[Tuple[int, int]]:
    """The addresses (start, end) of a loaded AOTInductor ``library``'s constants (its weights, between its symbols
    ``_binary_constants_bin_start`` and ``_end``), or None where it has no such symbols."""
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # loaded already: no second load
        start, end = (ctypes.addressof(ctypes.c_char.in_dll(handle, f"_binary_constants_bin_{edge}"))
                      for edge in ("start", "end"))
    except (OSError, ValueError):
        return None
    return start, end


def release_constant_pages(library: str) -> int:
    """Hand back to the kernel the pages of ``library``'s constants (``constants_range``: read-only file pages
    the unit copied at load) that are in memory; returns the bytes of address range released (0 where the library
    has no such constants)."""
    span = constants_range(library)
    if span is None:
        return 0
    first = -(-span[0] // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the constants only
    length = span[1] // mmap.PAGESIZE * mmap.PAGESIZE - first
    if length <= 0:
        return 0
    return length if libc_madvise()(first, length, mmap.MADV_DONTNEED) == 0 else 0


@functools.lru_cache(maxsize=None)
def libc_madvise():
    """libc's ``madvise(address, length, advice)``."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


class InductorLoaded:
    """A package loaded by inductor's loader, with :class:`LoadedPackage`'s methods."""

    def __init__(self, compiled):
        self.compiled, self.constants = compiled, None

    def __call__(self, *args):
        return self.compiled(*args)

    def constant_names(self):
        return self.compiled.get_constant_fqns()

    def keep_constants(self, constants: dict):
        self.compiled.load_constants(constants, check_full_update=True, user_managed=True)
        self.constants = constants
