"""Large CPU buffers reused from the heap instead of fresh pages (the default; ``--no-reuse-large-allocations``).

glibc's malloc serves a request above its mmap threshold (128 KiB, raised
when such a buffer is freed, but never above 32 MiB) with new pages from the
kernel and returns them on free.  Every page of such a buffer then faults
on first touch.  A decoder step over a large vocabulary allocates several
buffers of that size: beam 5 at batch 64 over a 32k vocabulary makes
(320, 32008) fp32 logits, 41 MB, and a log-softmax as large.  Filling such
a buffer then costs several times what it costs once the buffer comes from
the heap (docs/benchmarks.md, "Large buffers from the heap").

:func:`reuse_large_allocations` raises the mmap threshold (and the trim
threshold above it) with glibc's ``mallopt``, so those buffers come from the
heap and are reused after a free.  The setting is the process's, for every
allocation that follows: peak memory stays what the program allocates, but
freed memory stays with the process instead of going back to the kernel.
Values are unchanged; only where the bytes come from.  Building a generator
applies it unless ``--no-reuse-large-allocations``: stock PyTorch keeps no
CPU buffers of its own between a step and the next (CTranslate2 has its own
caching allocator), and at a base model's beam 5, batch 64 the faults took
a third of the step.  Where glibc's mallopt
is missing (macOS, musl) nothing changes and the call says so.
"""

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
# Requests up to this size come from the heap (glibc accepts up to about 2 GiB in an int)
HEAP_THRESHOLD_BYTES = 1 << 30
# Free memory at the top of the heap is returned to the kernel only above this
TRIM_THRESHOLD_BYTES = (1 << 31) - 1


def _mallopt():
    """glibc's ``mallopt``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


@functools.lru_cache(maxsize=None)
def reuse_large_allocations() -> bool:
    """Serve allocations up to HEAP_THRESHOLD_BYTES from the heap, for the rest of the process.
    Returns whether the C library took the settings.  Process-wide, so it runs once: later
    calls (every generator built with the option) return the first call's answer."""
    mallopt = _mallopt()
    taken = mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if taken:
        logger.info("buffers up to %d MiB are reused from the heap (--no-reuse-large-allocations: glibc's "
                    "default)", HEAP_THRESHOLD_BYTES >> 20)
    else:
        logger.warning("large buffers from the heap: this C library has no glibc mallopt; nothing changed")
    return taken
