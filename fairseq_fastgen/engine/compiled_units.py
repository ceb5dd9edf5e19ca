"""Which callable runs a step of ``--step-engine compiled``: every compiled unit is chosen here.

A unit is named by a key:

* an int: the row bucket of that many rows (through ``torch.compile``; with ``--compiled-freezing`` on
  the CPU a frozen unit compiled ahead of time);
* None: the step for every row count above the row buckets, compiled ahead of time (CPU);
* ``("beams", n)``: the same for sentences of n beams sharing their encoder-decoder keys;
* ``("block", n, rows)``: n positions per row (blockwise verification), rows None for any count;
* ``("encoder", 1)`` / ``("encoder", None)``: the encoder for one row / for more rows.

For a key the provider gives a unit loaded from disk, or compiled now and stored (``aot_step.py``), or
None: while a child process compiles it (``--compile-in-background``; one at a time, in the order the
decode needs them) or where it cannot be built (one line says why); the runner then runs that step
eager.  A unit holding the weights as constants is dropped when they change.
"""

import contextlib
import logging
import time
import types
import weakref
from typing import Dict, Optional

import torch

from fairseq_fastgen.engine import aot_step, f32_rows_weights
from fairseq_fastgen.engine.compiled_step import PaddedStep
from fairseq_fastgen.engine.fused_weights import FusedBuffers, FusedWeights, tensors_signature
from fairseq_fastgen.ops import int8_kernel

MAX_BUCKETS = 64  # compiled shapes kept per process
logger = logging.getLogger("fairseq_fastgen.engine")


class CompiledUnits:
    """The units of one runner: ``step`` is its padded step (one position, no beams); ``encoder_pass`` its
    encoder's (None: fairseq's encoder always); ``max_rows`` its largest row bucket; ``packages``: whether
    units are compiled ahead of time (on the CPU, where oneDNN serves); ``symbolic``: one torch.compile
    compilation for every bucket (CUDA); ``eager_products``: the context of eager work's products;
    ``many_rows_units``: whether steps above ``max_rows`` take a unit (else the runner's static step serves them)."""

    def __init__(self, step: PaddedStep, encoder_pass, max_rows: int, freezing: bool, packages: bool,
                 symbolic: bool, background: bool, eager_products, reduced_weights=None, many_rows_units=True):
        self.step, self.encoder_pass, self.max_rows = step, encoder_pass, max_rows
        self.many_rows_units = many_rows_units
        self.freezing, self.packages, self.symbolic = freezing, packages, symbolic
        self.compile_in_background, self.eager_products = background, eager_products
        # --quantize: fused weights -> the decoder's layers in int8 or bfloat16 (layer_weights.LayerWeights), which
        # every unit holds as constants; a bucket whose unit cannot be built runs eager (not through torch.compile)
        self.reduced_weights = reduced_weights
        # float32 and frozen, where the plugin's float32 kernel runs: the decoder step whose products the units of a
        # few rows compute through (f32_rows_weights.py), made with the weights it reads
        self.few_rows_step = None
        self.packaged: Dict[object, object] = {}  # key -> unit compiled ahead of time, or None (eager)
        self.compiled_now: set = set()  # keys of the units compiled in this process (the others were loaded)
        self.background = None  # (key, what, aot_step.BackgroundCompilation) of the unit being compiled, or None
        self.compiled_shapes: Dict[tuple, float] = {}  # (rows, positions, source) -> seconds of its first call
        # shapes met after dynamo's recompile limit was reached (a long-running server meets many): they run eager
        self.eager_shapes: set = set()
        self.compile_seconds = 0.0  # every first call of a shape, recompilations after a weight change included
        self._bucket_step = None  # made on first use: torch.compile loads dynamo and inductor (much memory)
        self.decoder_signature = None  # the decoder parameters (identity, version) frozen units hold
        self.encoder_signature = None  # the encoder parameters the encoder's units hold

    # ---- the decoder step ---------------------------------------------------------------------------
    def step_unit(self, rows: int, bucket: int, beams: int, capacity: int, fused: FusedWeights):
        """What runs the padded step of ``rows`` rows (the cache holding ``bucket`` rows of ``capacity`` target
        positions): above ``max_rows`` the unit for every row count (None where it cannot be built, off the CPU
        or without ``many_rows_units``: the runner's eager step), else the bucket's frozen unit with
        --compiled-freezing (its padded form, eager, while a child compiles it), or torch.compile's."""
        if rows > self.max_rows:
            serves = self.packages and self.many_rows_units
            return self.package_unit(None, beams, 1, capacity) if serves else None
        if self.freezing and self.packages:
            unit = self.package_unit(bucket, 1, 1, capacity)
            if unit is not None:
                return unit
            if bucket not in self.packaged or not self.buckets_through_torch_compile:  # compiled in the background
                return lambda *inputs: self.eager_padded(inputs, fused)
        return lambda *inputs: self.bucket_call(inputs, fused)

    @property
    def buckets_through_torch_compile(self) -> bool:
        """Whether a row bucket without a unit compiled ahead of time runs through torch.compile (else eager):
        not under --quantize, whose units hold their layers as frozen constants (layer_weights.py)."""
        return self.reduced_weights is None

    def block_unit(self, rows: int, bucket: int, block: int, beams: int, capacity: int):
        """The unit of ``block`` positions per row for ``rows`` rows, or None (eager).  One position (blockwise's
        bos, a row's last token): a frozen unit where head 1's scores come with the features (``scores_blocks``)."""
        if not self.packages or beams > 1:
            return None
        if block == 1:
            one_position = self.freezing and self.step.scores_blocks and rows <= self.max_rows
            return self.package_unit(bucket, 1, 1, capacity, one_position_block=True) if one_position else None
        if rows > self.max_rows:
            return self.package_unit(None, 1, block, capacity)
        return self.package_unit(bucket, 1, block, capacity) if self.freezing else None

    def many_rows_unit(self, beams: int):
        """The step for every row count above ``max_rows`` (None until built, or where it could not be)."""
        return self.packaged.get(None) or self.packaged.get(("beams", beams))

    def package_unit(self, rows: Optional[int], beams: int, block: int, capacity: int,
                     one_position_block: bool = False):
        """The padded step compiled ahead of time for ``rows`` rows (None: every row count above ``max_rows``;
        ``beams`` > 1: sentences of that many beams; ``block`` > 1 or ``one_position_block``: that many positions
        per row, as a block), built for buffers of ``capacity`` target positions when it is not built yet."""
        as_block = block > 1 or one_position_block
        key = ("block", block, rows) if as_block else rows if beams == 1 else ("beams", beams)
        if key in self.packaged:
            return self.packaged[key]
        if self.compile_in_background:
            if self.background is not None:  # polled at every step while a child compiles: nothing built before
                return self.poll_background(key)
            if key is None and beams > self.max_rows:
                return None  # beam search: only its sentences' unit is compiled; rows not laid out so run eager
        what = f"the step above {self.max_rows} rows" if rows is None else f"the step of {rows} rows"
        if as_block:
            what = what.replace("the step", f"the step of {block} position{'s' if block > 1 else ''} per row")
        if beams > 1:
            what += f" ({beams} beams a sentence, sharing its encoder-decoder keys)"
        decoder_step = self.few_rows_step if f32_rows_weights.serves(rows, block) else None
        step = self.step.shaped(beams, block, decoder_step, one_position_block)
        table = self.step.decoder_step.position_table(capacity)
        return self.built(key, what, lambda: aot_step.StepPackage(step, table, rows))

    def follow_decoder_weights(self, fused: FusedWeights):
        """Drop the units holding other decoder weights than the current ones as constants."""
        signature = tensors_signature(self.step.decoder_step.decoder.parameters())
        if signature == self.decoder_signature:
            return
        self.decoder_signature = signature
        if self.background is not None and not is_encoder(self.background[0]):  # an encoder's goes on
            self.background = None
        self.packaged = {key: unit for key, unit in self.packaged.items() if is_encoder(key)}
        self.step.decoder_step.fused_buffers = FusedBuffers(fused)  # a submodule: its buffers freeze
        if self.reduced_weights is not None:
            self.step.decoder_step.reduced = self.reduced_weights(fused)  # a submodule too
        elif self.freezing and self.packages and int8_kernel.f32_rows_available():  # float32: the kernel of a few rows
            decoder_step = self.step.decoder_step
            self.few_rows_step = decoder_step.with_products(
                f32_rows_weights.F32RowsWeights(decoder_step.decoder, fused.qkv_weights, fused.qkv_biases))
        if self.freezing:
            self._bucket_step, self.compiled_shapes = None, {}

    # ---- a row bucket through torch.compile ------------------------------------------------------
    @property
    def bucket_step(self):
        """The padded step through ``torch.compile``; a decode that never runs ``max_rows`` rows or fewer
        never loads it."""
        if self._bucket_step is None:
            # one compiled graph per bucket: room for every bucket of a long decode (dynamo's default is 8)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_BUCKETS)
            # torch.compile keeps compiled code per code object, and the guards that would tell steps apart are
            # dropped (inductor_options): frozen weights get a copy of the method with a code object of its own
            # (code compiled for older weights, as constants, must not be reused); unfrozen, the runners of one
            # decoder with the same settings share one (a second generator reuses the first one's compilations),
            # and a step of other settings (one that returns features for a projection) gets another
            if self.freezing:
                step = own_code(self.step.forward)
            else:
                step = shared_code(self.step.forward, self.step.decoder_step.decoder, self.step.settings())
            options = inductor_options(self.step, self.symbolic)
            self._bucket_step = torch.compile(step, dynamic=self.symbolic, fullgraph=True, options=options)
        return self._bucket_step

    def bucket_call(self, inputs, fused: FusedWeights):
        """The step of a row bucket through torch.compile (one compilation per bucket and process)."""
        self_keys, cross_keys = inputs[4][0], inputs[6][0]
        shape = (self_keys.size(0), self_keys.size(2), cross_keys.size(2))  # rows, target and source positions
        on_cuda = self_keys.device.type == "cuda"
        if shape in self.eager_shapes:
            return self.eager_padded(inputs, fused)
        start = time.perf_counter()
        with self.compile_settings(shape):
            if on_cuda:  # a new replay may overwrite the outputs of the last one: the runner has copied them
                torch.compiler.cudagraph_mark_step_begin()
            try:
                outputs = self.bucket_step(*inputs) if self.freezing else self.bucket_step(*inputs, fused)
            except torch._dynamo.exc.FailOnRecompileLimitHit:  # fullgraph: dynamo refuses one more compilation
                if not self.eager_shapes:
                    logger.warning(f"--step-engine compiled: {len(self.compiled_shapes)} step shapes compiled in "
                                   f"this process, dynamo's limit; further shapes run uncompiled")
                self.eager_shapes.add(shape)
                return self.eager_padded(inputs, fused)
        if shape not in self.compiled_shapes:
            self.compiled_shapes[shape] = seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            # a bucket served by code compiled for another (symbolic shapes) or found in inductor's cache: no news
            logger.log(logging.INFO if seconds >= 1.0 else logging.DEBUG,
                       f"--step-engine compiled: step for {shape[0]} rows, {shape[1]} target and {shape[2]} "
                       f"source positions compiled in {seconds:.1f} s")
        return outputs

    def eager_padded(self, inputs, fused: FusedWeights):
        """The padded step of a bucket whose unit a child process compiles: uncompiled, oneDNN's products."""
        with self.eager_products():
            return self.step(*inputs, fused)

    def compile_settings(self, shape):
        """Inductor's settings around a call that compiles a new bucket: with --compiled-freezing the weights
        become constants of the compiled code (inductor reads ``freezing`` before a torch.compile call's own
        options apply) and their products take its C++ GEMM template, faster at one row at the price of a
        longer compilation per bucket.  With symbolic shapes every input dimension gets a symbol of its own:
        dynamo would otherwise give one symbol to dimensions that happen to be equal at the first call (64
        rows and a head of 64 values) and compile again once they differ."""
        if shape in self.compiled_shapes or not (self.freezing or self.symbolic):
            return contextlib.nullcontext()
        if self.symbolic:
            import torch.fx.experimental._config as fx_config  # torch's own, loaded with torch.compile

            return fx_config.patch(use_duck_shape=False)
        import torch._inductor.config as inductor_config  # torch's own, loaded with torch.compile

        return inductor_config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")

    # ---- the encoder ------------------------------------------------------------------------------
    def encoder_unit(self, rows: int):
        """The encoder compiled ahead of time for ``rows`` rows (1, or any more), or None (fairseq's encoder).
        With --compile-in-background the steps' units come first (a decode spends more on its steps), unless
        the steps of more rows than ``max_rows`` take none (--compiled-many-rows static) and ``rows`` are more."""
        if self.encoder_pass is None:
            return None
        key = ("encoder", 1 if rows == 1 else None)
        signature = tensors_signature(self.encoder_pass.encoder.parameters())
        if signature != self.encoder_signature:  # units holding other weights as constants: dropped
            self.encoder_pass.follow_weights()
            self.encoder_signature = signature
            for unit in [("encoder", 1), ("encoder", None)]:
                self.packaged.pop(unit, None)
        if key in self.packaged:
            return self.packaged[key]
        if self.compile_in_background:
            if self.background is not None:
                return self.poll_background(key)
            steps_first = self.many_rows_units or rows <= self.max_rows
            if steps_first and not any(unit is not None for name, unit in self.packaged.items()
                                       if not is_encoder(name)):
                return None
        what = f"the encoder for {'one row' if rows == 1 else 'more rows'}"
        return self.built(key, what, lambda: aot_step.EncoderPackage(self.encoder_pass, key[1]))

    # ---- units compiled ahead of time ---------------------------------------------------------------
    def built(self, key, what: str, package):
        """The unit ``package()`` describes (an ``aot_step`` package), loaded or compiled (with
        --compile-in-background and no child compiling: by a child process, None until it is ready); None
        where it cannot be built (one line says why)."""
        try:
            package = package()
            if self.compile_in_background:
                path = package.path
                if not path.exists():
                    compilation = aot_step.BackgroundCompilation(package, path)
                    self.background = (key, what, compilation)
                    logger.info(f"--step-engine compiled: {what} is compiled in the background (process "
                                f"{compilation.pid}, which stores it in {path.parent} even if this decode ends "
                                f"first); those steps run eager until it is ready")
                    return None
            unit, seconds, compiled_now = aot_step.load_or_compile(package)
        except Exception as error:  # export or inductor refusing this model: eager, or torch.compile, serves it
            return self.not_built(key, what, error)
        return self.keep(key, what, unit, seconds, compiled_now)

    def poll_background(self, key):
        """The unit the child process compiles, once it is ready (polled); None before, and for every other
        key while one is compiled in the background (they run eager; the next is compiled after it)."""
        compiling, what, compilation = self.background
        if key != compiling:
            return None
        try:
            ready = compilation.ready()  # (unit, seconds) or None
        except Exception as error:
            self.background = None
            return self.not_built(key, what, error)
        if ready is None:
            return None
        self.background = None
        return self.keep(key, what + " (in the background)", *ready, compiled_now=True)

    def not_built(self, key, what: str, error: Exception):
        self.packaged[key] = None
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        fallback = ("torch.compile compiles it" if isinstance(key, int) and self.buckets_through_torch_compile
                    else "fairseq's encoder runs" if is_encoder(key) else "those steps run eager")
        logger.warning(f"--step-engine compiled: {what} could not be compiled ahead of time ({reason}); {fallback}")
        return None

    def keep(self, key, what: str, unit, seconds: float, compiled_now: bool):
        self.packaged[key] = unit
        self.compile_seconds += seconds
        if isinstance(key, int):
            self.compiled_shapes[(key, None, None)] = seconds
        if compiled_now:
            self.compiled_now.add(key)
        done = "compiled and stored" if compiled_now else "loaded"
        logger.info(f"--step-engine compiled: {what} {done} in {seconds:.1f} s ({aot_step.compiled_dir()})")
        return unit

    def statistics(self) -> dict:
        """The buckets met and the seconds of their first calls (their compilation, or its load from disk)."""
        packaged = sum(1 for key, unit in self.packaged.items()
                       if unit is not None and not isinstance(key, int) and not is_encoder(key))
        buckets = len(self.compiled_shapes) + packaged  # the units above the buckets, and the block units
        return {"compiled_buckets": buckets, "compile_seconds": round(self.compile_seconds, 2)}


def is_encoder(key) -> bool:
    """Whether a unit's key is an encoder unit's."""
    return isinstance(key, tuple) and key[0] == "encoder"


def own_code(method, code=None):
    """``method`` bound again to a copy of its function with a code object of its own (or ``code``)."""
    function = method.__func__
    copy = types.FunctionType(code or function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


# decoder -> step settings (PaddedStep.settings) -> the code object its unfrozen steps are compiled under
SHARED_CODE: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[tuple, types.CodeType]]" = weakref.WeakKeyDictionary()


def shared_code(method, decoder: torch.nn.Module, settings: tuple):
    """``method`` bound again to a copy of its function whose code object is shared by the steps of ``decoder``
    with the same ``settings``, and by no other."""
    codes = SHARED_CODE.setdefault(decoder, {})
    return own_code(method, codes.setdefault(settings, method.__func__.__code__.replace()))


def inductor_options(module, symbolic: bool) -> dict:
    on_cpu = next(module.parameters()).device.type == "cpu"
    options = {"cpp_wrapper": True} if on_cpu else {"triton.cudagraphs": True}
    # only the inputs' shapes, dtypes and strides choose a compiled bucket: the model, the temperature and the
    # projection of a runner never change, and checking their guards is a visible share of a one-row step
    # (each decoder and settings compile under a code object of their own: CompiledUnits.bucket_step)
    # (with symbolic shapes the guards relating them to each other stay)
    if not symbolic:
        options["guard_filter_fn"] = torch.compiler.keep_tensor_guards_unsafe
    return options
