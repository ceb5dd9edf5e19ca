"""Peak memory of one configuration's warm-up pass.

CPU: the process's peak resident set size (VmHWM).  Linux resets it when "5"
is written to /proc/self/clear_refs, so each configuration gets its own peak;
where that is refused the peak is the process's since start (``scope``
says which).  Python's tracemalloc would miss tensor memory, which torch
allocates outside Python's allocator.  CUDA: torch's max allocated bytes.
"""

import resource
import sys

import torch

MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def rss_mib() -> float:
    """The process's resident memory now (VmRSS), in MiB; nan where /proc has none."""
    try:
        return _status_kib("VmRSS") / 1024
    except (OSError, KeyError):
        return float("nan")


def _peak_rss_mib() -> float:
    try:
        return _status_kib("VmHWM") / 1024
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (MIB if sys.platform == "darwin" else 1024)


class PeakMemory:
    """``with PeakMemory(cuda) as meter: ...``; then ``meter.report`` (MiB)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.report = {}

    def __enter__(self):
        self.per_config = _reset_peak_rss()
        self.rss_before = rss_mib()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_before = torch.cuda.memory_allocated() / MIB
        return self

    def __exit__(self, *exc_info):
        peak = _peak_rss_mib()
        self.report = {
            "cpu_peak_rss_mib": round(peak, 1),
            "cpu_rss_growth_mib": round(max(0.0, peak - self.rss_before), 1),  # the peak includes rss_before
            "cpu_peak_scope": "configuration" if self.per_config else "process",
        }
        if self.cuda:
            torch.cuda.synchronize()
            peak_cuda = torch.cuda.max_memory_allocated() / MIB
            self.report["cuda_max_allocated_mib"] = round(peak_cuda, 1)
            self.report["cuda_growth_mib"] = round(max(0.0, peak_cuda - self.cuda_before), 1)
        return False
