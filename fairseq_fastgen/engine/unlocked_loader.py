"""Compiled units whose calls release Python's GIL (``kernels/unlocked_unit_cpu.cpp``), built once per machine.

torch's Python binding of AOTInductor's package loader holds the GIL while the compiled code runs: a decoder step
of the compiled engine stops every other Python thread of the process for its whole length (measured: a second
thread spinning in Python ran at 8% of its own rate while units ran, above 100% while eager torch operations
did). fastgen-serve's event loop, which takes the requests, tokenizes them and answers them, and
fairseq-interactive's reader of input lines (``cli/live_lines.py``) then wait for the steps instead of running
beside them.
``UnlockedLoader`` is the same C++ loader of torch with the GIL released around the run, built by torch's
extension builder into ``$FASTGEN_CACHE/unlocked-unit-<key>`` on first use (about 30 s) and imported from there.
Where it cannot be built (no compiler, no headers) ``loader_class()`` is None and torch's loader serves, as
before; one line says why.  ``FASTGEN_UNLOCKED_UNITS=0`` asks for torch's loader anyway, for comparison.
"""

import functools
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

from fairseq_fastgen.ops.int8_kernel import source_paths
from fairseq_fastgen.safe_files import cached_build

logger = logging.getLogger("fairseq_fastgen.engine")

MODULE_NAME = "fastgen_unlocked_unit"
SOURCE_NAMES = ("unlocked_unit_cpu.cpp",)  # found as int8_kernel finds its own: the installed kernels/, the checkout's


def build(folder: Path) -> None:
    """Compile the module into ``folder`` (cached_build's fresh directory)."""
    from torch.utils import cpp_extension

    cpp_extension.load(name=MODULE_NAME, sources=[str(path) for path in source_paths(SOURCE_NAMES)],
                       extra_cflags=["-O2"], build_directory=str(folder), is_python_module=True, verbose=False)


@functools.lru_cache(maxsize=None)
def loader_class():
    """``UnlockedLoader(package_path)``, or None where the module cannot be built here."""
    if os.environ.get("FASTGEN_UNLOCKED_UNITS", "1") == "0":  # torch's loader, to measure what this one brings
        return None
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME].UnlockedLoader
    try:
        sources = (path.read_bytes() for path in source_paths(SOURCE_NAMES))
        key = (*sources, torch.__version__, sys.version)  # (a module of this Python's ABI)
        folder = cached_build("unlocked-unit", key, build)
        if MODULE_NAME not in sys.modules:  # built by another process (or an earlier run): import what it built
            (library,) = folder.glob(f"{MODULE_NAME}*.so")
            spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[MODULE_NAME] = module
    except Exception as error:  # no compiler, no ninja, no headers: torch's loader serves
        logger.warning("compiled units hold Python's GIL while they run: the loader that releases it did not build "
                       "(%s)", str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
        return None
    return sys.modules[MODULE_NAME].UnlockedLoader

