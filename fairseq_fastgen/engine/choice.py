"""Which runner runs a decoder's steps: ``--step-engine`` checked with the options that depend on it, ``auto``
(the default) resolved for the model it serves, the model the engine must serve (else fairseq's, in one line),
and the runner built.

``auto`` runs the fastest path measured where it keeps every decoder's exactness promise: on the CPU, in float32,
int8 or bfloat16, ``compiled`` with its row buckets frozen (``--compiled-freezing``) and every unit not on disk yet
compiled by a child process while the decode runs those steps eager (``--compile-in-background``): a first run on a new
model does not wait for the compiler, later runs load the units; above the row buckets, on a processor without AVX-512,
the static engine's step with the plugin's float32 kernel's products, and the encoder through them
(``compiled_many_rows``).  Elsewhere (CUDA, where the compiled engine's buckets compile in the decoding process, half
precision) ``static``.  ``$FASTGEN_STEP_ENGINE`` names the engine ``auto`` runs instead (``static`` for bitwise
fairseq's hypotheses in a whole pipeline without editing its commands)."""

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.decoder_step import unsupported_reason
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.ops import int8_kernel, precision_linear
from fairseq_fastgen.ops.f32_rows_linear import many_rows_kernel_available

ENGINES = ("auto", "fairseq", "static", "compiled")
AUTO_ENGINE_ENV = "FASTGEN_STEP_ENGINE"  # the engine --step-engine auto runs, where set
logger = logging.getLogger("fairseq_fastgen.engine")


_quantized_fallback_named = []  # the line saying compiled falls back under --quantize: once per process
_slow_bfloat16_named = []  # the line saying --quantize bf16 is slower than float32 here: once per process


def compiled_precision_refusal(options: PluginOptions) -> Optional[str]:
    """Why ``--step-engine compiled`` cannot compute ``--quantize``'s products in its units (it then falls back to
    ``static``), or None: its units compute int8 through the plugin's kernel (``int8_weights.py``) and bfloat16
    through inductor's products (``bf16_weights.py``)."""
    if options.quantize == "bf16":
        return precision_linear.precision_refusal("bf16")
    if options.quantize != "int8":
        return f"its units compute in float32, int8 or bf16: --quantize {options.quantize}"
    if options.int8_library_kernels:
        return "its units compute int8 through the plugin's kernel: --int8-library-kernels"
    if not int8_kernel.available():
        return "its units compute int8 through the plugin's kernel, which does not run here"
    return None


def cache_capacity(max_len) -> int:
    """Target positions a cache needs for rows whose length limits are ``max_len`` (rows,): the bos,
    up to ``max_len`` tokens and the forced eos."""
    return int(max_len.max()) + 2 if max_len.numel() else 1


@dataclass(frozen=True)
class EngineChoice:
    """The runner --step-engine resolves to: ``engine`` one of fairseq, static, compiled; ``freezing`` and
    ``background``: --compiled-freezing and --compile-in-background, implied where ``auto`` chose compiled."""

    engine: str
    freezing: bool = False
    background: bool = False


AUTO_ON_CPU = EngineChoice("compiled", freezing=True, background=True)  # what auto runs on the CPU


def name_slower_bfloat16(options: PluginOptions, model) -> None:
    """One warning line, once a process, where ``--quantize bf16`` decodes on a CPU whose native bfloat16 products
    are slower than its float32 ones (``precision_linear.bfloat16_slower``); the decode goes on in bfloat16."""
    if (options.quantize != "bf16" or _slow_bfloat16_named or not on_cpu(model)
            or precision_linear.precision_refusal("bf16") is not None):
        return
    slower = precision_linear.bfloat16_slower()
    if slower is not None:
        _slow_bfloat16_named.append(True)
        logger.warning(f"--quantize bf16: {slower}; without --quantize the decode is likely faster")


def engine_choice(options: PluginOptions, model=None) -> EngineChoice:
    """``--step-engine``, checked with the options that depend on it; ``auto`` resolved for ``model`` (None: a
    float32 model on the CPU)."""
    engine = options.step_engine
    if engine not in ENGINES:
        raise ValueError(f"--step-engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    name_slower_bfloat16(options, model)
    for name in ("compiled_freezing", "compile_in_background"):
        if getattr(options, name) and engine not in ("compiled", "auto"):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} applies to --step-engine compiled; got --step-engine {engine}")
    many_rows = many_rows_setting(options)
    if many_rows != "auto" and engine not in ("compiled", "auto"):
        raise ValueError(f"--compiled-many-rows applies to --step-engine compiled; got --step-engine {engine}")
    if many_rows in ("static", "kernel") and compiled_precision(options) is not None:
        raise ValueError(f"--compiled-many-rows {many_rows} runs float32 steps; the compiled engine's units compute "
                         f"--quantize {options.quantize}: leave it out")
    if many_rows == "kernel" and not many_rows_kernel_available():
        raise ValueError("--compiled-many-rows kernel runs the plugin's float32 kernel for AVX2, which this machine "
                         "does not build or run: use static or unit")
    if engine == "auto":
        configured = os.environ.get(AUTO_ENGINE_ENV)
        if not configured:
            return auto_choice(options, model)
        if configured not in ENGINES[1:]:
            raise ValueError(f"${AUTO_ENGINE_ENV} must be one of {', '.join(ENGINES[1:])}; got {configured!r}")
        engine = configured  # the engine as named, its flags as given
    if engine != "compiled":
        return EngineChoice(engine)
    refusal = compiled_precision_refusal(options) if options.quantize else None
    if refusal is None:
        return EngineChoice(engine, options.compiled_freezing, options.compile_in_background)
    if not _quantized_fallback_named:
        _quantized_fallback_named.append(True)
        logger.warning(f"--step-engine compiled: {refusal}; runs on --step-engine static")
    return EngineChoice("static")


def on_cpu(model) -> bool:
    """Whether ``model`` (None: a model on the CPU) has its weights on the CPU."""
    parameter = next(model.parameters(), None) if model is not None else None
    return parameter is None or parameter.device.type == "cpu"


def auto_choice(options: PluginOptions, model=None) -> EngineChoice:
    """What ``--step-engine auto`` runs for ``model`` (None: a float32 model on the CPU) where
    $FASTGEN_STEP_ENGINE names no engine: ``AUTO_ON_CPU`` on the CPU in float32, int8 or bfloat16 (the compiled
    units compute each), ``static`` elsewhere: on CUDA the compiled engine's buckets compile through torch.compile
    in the decoding process (about a minute for the toy model on an H200), which a first run would wait for, and it
    has no half-precision units."""
    parameter = next(model.parameters(), None) if model is not None else None
    if parameter is not None and (parameter.device.type != "cpu" or parameter.dtype != torch.float32):
        return EngineChoice("static")
    if options.quantize and compiled_precision_refusal(options) is not None:
        return EngineChoice("static")
    return AUTO_ON_CPU


def engine_setting(options: PluginOptions, model=None) -> str:
    """The engine ``--step-engine`` resolves to for ``model``: fairseq, static or compiled."""
    return engine_choice(options, model).engine


def engine_refusal(model, options: PluginOptions) -> Optional[str]:
    """Why the step engine ``--step-engine`` asks for cannot run ``model``'s steps (``build_runner`` then falls
    back to fairseq's incremental decoder), or None where it can or fairseq's was asked for."""
    return refusal_of(model, engine_setting(options, model))


def refusal_of(model, engine: str) -> Optional[str]:
    """Why ``engine`` (resolved: no ``auto``) cannot run ``model``'s steps, or None (always for ``fairseq``)."""
    return unsupported_reason(model.decoder) if engine != "fairseq" else None


def engine_serves(model, options: PluginOptions) -> bool:
    """Whether a step engine (``static`` or ``compiled``), not fairseq's incremental decoder, runs ``model``'s
    steps under ``options``: the runner ``build_runner`` gives."""
    engine = engine_setting(options, model)
    return engine != "fairseq" and refusal_of(model, engine) is None


def build_runner(model, options: PluginOptions, temperature: float, projection):
    """The runner ``--step-engine`` asks for, or fairseq's with one line saying why not
    (``temperature``: fairseq's ``--temperature``)."""
    choice = engine_choice(options, model)
    engine = choice.engine
    refusal = refusal_of(model, engine)
    if refusal:
        logger.warning(f"--step-engine {engine}: {refusal}; using --step-engine fairseq")
        engine = "fairseq"
    return make_runner(engine, model, temperature, projection, choice.freezing,
                       background=choice.background, blocks_by_position=options.quantize == "int8",
                       precision=compiled_precision(options), many_rows=compiled_many_rows(options))


def compiled_precision(options: PluginOptions) -> Optional[str]:
    """The precision of the compiled engine's units under ``options``: "int8" (every linear layer int8 that
    --quantize int8 serves), "int8-layers" (the vocabulary projection in float32: --float32-vocabulary-projection),
    "bf16", or None (float32)."""
    if not options.quantize or compiled_precision_refusal(options) is not None:
        return None
    if options.quantize == "int8" and options.float32_vocabulary_projection:
        return "int8-layers"
    return options.quantize


def many_rows_setting(options: PluginOptions) -> str:
    """``--compiled-many-rows`` as given: auto, unit, static or kernel."""
    return str(getattr(options, "compiled_many_rows", "auto"))


def compiled_many_rows(options: PluginOptions) -> str:
    """What runs the compiled engine's one-position steps above its row buckets under ``options``: "unit" (one
    step compiled ahead of time for every row count), "static" (the static engine's step, eager) or "kernel" (that
    step with the plugin's float32 kernel's products; the runner takes torch's where the kernel does not run):
    ``--compiled-many-rows``, its ``auto`` resolved: "kernel" in float32 on a processor without AVX-512 (there the
    unit's oneDNN products ran slower than torch's at 64 and 320 rows, and the kernel's faster than both:
    docs/benchmarks.md), else "unit"."""
    setting = many_rows_setting(options)
    if setting != "auto":
        return setting
    return "unit" if compiled_precision(options) is not None or avx512_processor() else "kernel"


def avx512_processor() -> bool:
    """Whether torch's CPU kernels run AVX-512 instructions on this processor."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def make_runner(engine: str, model, temperature: float, projection, freezing: bool = False, beams: int = 1,
                background: bool = False, blocks_by_position: bool = False, precision: Optional[str] = None,
                many_rows: str = "unit"):
    """The runner of ``engine`` for ``model`` (no checks: build_runner's and serve_stock_search's job);
    ``beams``: the rows of a sentence in fairseq's beam search (sharing their encoder-decoder keys);
    ``freezing``, ``background``: --compiled-freezing, --compile-in-background;
    ``blocks_by_position``: the static engine's blocks attend position by position (--quantize int8:
    ``DecoderStep``'s exact form); ``precision``: what the compiled engine's units compute in
    (``compiled_precision``); ``many_rows``: what runs its steps above its row buckets (``compiled_many_rows``)."""
    if engine == "static":
        return StaticRunner(model, temperature, projection, blocks_by_position, beams)
    if engine == "compiled":
        return CompiledRunner(model, temperature, projection, freezing, beams, background, precision, many_rows)
    return ModelRunner(model, temperature, projection, beams)
