"""The plugin's own int8 product on the CPU (``kernels/int8_rows_cpu.cpp``), built once per machine, with its
float32 product of a few rows (``kernels/f32_rows_cpu.cpp``) beside it.

``--quantize int8`` rounds each input row to int8 on a scale of its own and multiplies it with int8 weight rows
(``precision_linear.Int8Rows``).  At one to a few rows fbgemm's and oneDNN's products spend most of their time in
fixed costs, and the rounding around them is five torch calls; the kernel does the rounding, the product and the
scaling in one call and gives the same bits (``tests/ops/test_int8_kernel.py``).  It is built for the processor:
with AVX-512 VNNI (inputs in [-127, 127]) or with AVX2 (inputs in [-63, 63], fbgemm's 7-bit inputs there, which
keep its int16 pair sums exact): ``INPUT_LEVELS``.  Where the processor also has AMX, products of 16 rows or more
run on its int8 tiles, with the same exact int32 sums (``AMX``).

The C++ source is compiled by torch's extension builder (ninja, the system's C++ compiler) on first use into
``$FASTGEN_CACHE/int8-kernel-<key>`` (the key: the source, torch's version and the flags), then loaded from there;
its op is ``torch.ops.fastgen.int8_rows_linear``, with its output's shape registered for tracing, so that the
compiled engine's units call it (``engine/int8_weights.py``).  Both builds also hold
``torch.ops.fastgen.f32_rows_linear`` (``f32_rows_available()``; AVX2 with FMA, which every AVX2 processor of
Intel's and AMD's has), which the compiled engine's frozen float32 units of a few rows call
(``engine/f32_rows_weights.py``).  Where the processor lacks AVX2, or the build fails (one
warning line says why), ``available()`` is False and int8 products stay on fbgemm's and oneDNN's kernels
(``--int8-library-kernels`` asks for those anyway, for comparison).
"""

import functools
import logging
import os
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_fastgen.safe_files import cached_build

logger = logging.getLogger("fairseq_fastgen.ops")

SOURCE_NAMES = ("int8_rows_cpu.cpp", "f32_rows_cpu.cpp")  # one library
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
SOURCE_DIRS = (_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels")  # installed package, then checkout
VNNI = torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()
# Each input row is rounded to integers in [-INPUT_LEVELS, INPUT_LEVELS] on a scale of its own, by every int8 kernel
# (this one and fbgemm's and oneDNN's, precision_linear.Int8Rows). Without VNNI the int8 kernels sum pairs of
# products in int16 and need 7-bit inputs to stay clear of saturation.
INPUT_LEVELS = 127 if VNNI else 63
# AMX's int8 tiles (Intel Xeon from Sapphire Rapids on): the VNNI build also multiplies 16 or more rows in tiles
# (FASTGEN_INT8_TILES=0 leaves them out, to measure what they bring)
AMX = VNNI and torch.cpu._is_amx_tile_supported() and os.environ.get("FASTGEN_INT8_TILES", "1") != "0"
# FASTGEN_F32_ROWS=0 leaves the float32 kernel of a few rows out of the compiled units, to measure what it brings
F32_ROWS_PERMITTED = os.environ.get("FASTGEN_F32_ROWS", "1") != "0"
# (-mfma: gcc does not imply it with -mavx512f, and the float32 kernel's AVX2 passes, which both builds run, use it)
INSTRUCTIONS = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma"]
                + (["-mamx-tile", "-mamx-int8"] if AMX else [])) if VNNI else ["-mavx2", "-mfma"]
# the kernels prefetch the weights' next lines into the L2 cache (T1): on an AMD Zen 5 blockwise's block of 4 rows ran
# 12-25% faster than with T0 (the L1), in float32 and in int8; FASTGEN_PREFETCH_HINT=T0, T2 or NTA builds them with
# another hint, to measure what it changes (benchmarks/model_sizes.sh, row "prefetch")
PREFETCH_HINT = os.environ.get("FASTGEN_PREFETCH_HINT", "T1")
if PREFETCH_HINT not in ("T0", "T1", "T2", "NTA"):
    raise SystemExit(f"FASTGEN_PREFETCH_HINT={PREFETCH_HINT}: one of T0, T1, T2, NTA")
FLAGS = ["-O3", *INSTRUCTIONS, f"-DFASTGEN_INPUT_LEVELS={INPUT_LEVELS}",
         f"-DFASTGEN_PREFETCH_HINT=_MM_HINT_{PREFETCH_HINT}", "-ffp-contract=off", "-fopenmp"]
GROUP = 64  # output rows per group of the packed layout (the kernel's kGroup)


def processor_refusal() -> Optional[str]:
    """Why the kernel cannot run here, or None."""
    if not (VNNI or torch.cpu._is_avx2_supported()):
        return "the processor has neither AVX-512 VNNI nor AVX2"
    return None


def source_paths(names=SOURCE_NAMES) -> List[Path]:
    """The C++ sources ``names`` from the first of SOURCE_DIRS that holds them all."""
    for folder in SOURCE_DIRS:
        if all((folder / name).is_file() for name in names):
            return [folder / name for name in names]
    raise FileNotFoundError(f"{', '.join(names)} are in none of {', '.join(map(str, SOURCE_DIRS))}")


def build(folder: Path) -> None:
    """Compile the kernel into ``folder`` (cached_build's fresh directory)."""
    from torch.utils import cpp_extension

    cpp_extension.load(name="fastgen_int8_rows", sources=[str(path) for path in source_paths()], extra_cflags=FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                       verbose=False)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether ``torch.ops.fastgen.int8_rows_linear`` runs here (built and loaded on the first call)."""
    refusal = processor_refusal()
    if refusal is not None:
        logger.info("int8 products through fbgemm and oneDNN: %s", refusal)
        return False
    if hasattr(torch.ops.fastgen, "int8_rows_linear"):
        return True
    try:
        key = (*(path.read_bytes() for path in source_paths()), torch.__version__, " ".join(FLAGS))
        folder = cached_build("int8-kernel", key, build)
        if not hasattr(torch.ops.fastgen, "int8_rows_linear"):  # built by another process: cpp_extension loads
            torch.ops.load_library(str(folder / "fastgen_int8_rows.so"))  # what it builds
    except Exception as error:  # no compiler, no ninja, no headers: the library kernels serve
        logger.warning("int8 products through fbgemm and oneDNN: the plugin's int8 kernel did not build (%s)",
                       str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
        return False
    register_output_shape()
    return True


def register_output_shape():
    """The ops' outputs for tracing (torch.export, inductor): x (rows, in) -> (rows, out_features) float32."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fastgen::int8_rows_linear", "Meta"):
        @torch.library.register_fake("fastgen::int8_rows_linear")
        def int8_rows_linear_output(x, packed, weight_scales, offsets, out_features, bias):
            return x.new_empty(x.size(0), out_features)

    if hasattr(torch.ops.fastgen, "f32_rows_linear") and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "fastgen::f32_rows_linear", "Meta"):
        @torch.library.register_fake("fastgen::f32_rows_linear")
        def f32_rows_linear_output(x, packed, bias, out_features):
            return x.new_empty(x.size(0), out_features)


def f32_rows_available() -> bool:
    """Whether ``torch.ops.fastgen.f32_rows_linear`` runs here (built and loaded with the int8 kernel on the first
    call; not under ``FASTGEN_F32_ROWS=0``: ``F32_ROWS_PERMITTED``)."""
    return F32_ROWS_PERMITTED and available() and hasattr(torch.ops.fastgen, "f32_rows_linear")


def pack_rows(integers: Tensor) -> Tuple[Tensor, Tensor]:
    """integers (out, in) int8 -> the kernel's layout (out/64, in/4, 64, 4) int8 and the offsets (out,) int32
    ((INPUT_LEVELS + 1) x each row's sum: the kernel's inputs enter as unsigned bytes q + INPUT_LEVELS + 1), both
    padded to whole groups."""
    out_features, in_features = integers.shape
    out_padded = -(-out_features // GROUP) * GROUP
    in_padded = -(-in_features // 4) * 4
    padded = torch.zeros(out_padded, in_padded, dtype=torch.int8)
    padded[:out_features, :in_features] = integers
    packed = padded.view(out_padded // GROUP, GROUP, in_padded // 4, 4).permute(0, 2, 1, 3).contiguous()
    offsets = padded.sum(dim=1, dtype=torch.int32).mul_(INPUT_LEVELS + 1)  # (out_padded,)
    return packed, offsets


class KernelRows:
    """A weight's int8 rows in the kernel's layout: ``self(x, bias)`` is the product of x (rows, in) float32."""

    def __init__(self, integers: Tensor, scales: Tensor):
        if not available():  # builds and loads the op on first use in this process
            raise RuntimeError("the plugin's int8 kernel does not run here: " + (processor_refusal() or "its build "
                               "failed (see the warning above)"))
        self.out_features = integers.size(0)
        self.packed, self.offsets = pack_rows(integers)
        self.scales = torch.zeros(self.offsets.numel())  # (out_padded,) float32
        self.scales[:self.out_features] = scales

    def __call__(self, rows: Tensor, bias: Optional[Tensor]) -> Tensor:
        return torch.ops.fastgen.int8_rows_linear(rows, self.packed, self.scales, self.offsets, self.out_features,
                                                  bias)
