"""``--step-engine compiled``: the padded decoder step through ``torch.compile``.

A decode meets few shapes: the cache of a state holds its rows padded up to a
row bucket (1 or 2 rows; the padding rows repeat row 0 and are never
read back), its target positions up to ``POSITION_BUCKET`` times a power of two
(``bucket_capacity``) and its source positions up to a multiple of
``SOURCE_BUCKET`` (masked).  Each
(rows, positions, source) bucket is compiled once per process (inductor's
on-disk cache keeps the generated code for the next process); the time each
compilation took is logged and counted (``compile_seconds``).

Above ``COMPILED_MAX_ROWS`` rows (``FROZEN_MAX_ROWS`` with ``--compiled-freezing``,
which folds the weights into the compiled code), on the CPU, one more compiled
unit serves every row count: the same padded step with its rows, target and
source widths symbolic and its weights frozen, compiled ahead of time by
AOTInductor and kept on disk between processes (``aot_step.py``); its products
are oneDNN's prepacked ones, which run faster than MKL's at many rows on CPUs
where MKL takes its generic path (docs/benchmarks.md, "Products and memory on
the CPU").  Rows joined at different lengths
(``step_rows``: streaming refills in finished rows' places) and rows holding
left padding take the same units, each row at its own position and attending
only its own positions (``StaticCache.attended``).  Blockwise verification
(``step_block``: a block of positions per row) runs a unit of its own of the
same kind, above the buckets and, with ``--compiled-freezing``, per bucket;
shorter blocks are padded to the widest.  Where no unit can be built (or, with
--compile-in-background, while a child process compiles it), the step runs
eager, in the decoder step's fast form (the exact form for blocks and left
padding), its linear layers through oneDNN's prepacked products on the CPU
(``ops/onednn_linear.py``).

On the CPU the encoder runs a unit compiled ahead of time too (``encoder_pass.py``:
one for a row, one for more; with --compile-in-background compiled once a step's
unit is stored): at batch 1 it spares the Python dispatch of the encoder's many
small operations.

On CUDA the row buckets go up to ``CUDA_MAX_ROWS`` rows (powers of two), all
served by one compilation whose shapes are symbolic, each bucket replayed as a
CUDA graph (``triton.cudagraphs``): a step of a small model there costs its
kernel launches, not its padding rows.

On the CPU inductor fuses the operations between the products into C++
loops and calls the products themselves as MKL's (at a few rows its
matrix-vector products beat oneDNN's prepacked ones, whose calls cost more),
through a C++ wrapper; a call checks only the
guards of its input tensors.  The self-attention's query, key and value
projections run as one product and the vocabulary projection reads its weight
transposed (``fused_weights.py``).  The padded step sums its softmaxes over the
whole buffer and fuses operations, so scores differ from fairseq's in the last
bits: the tests hold the tokens equal and the scores within 1e-4.
"""

import contextlib
import logging
import time
import types
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears
from fairseq_fastgen.engine.encoder_pass import EncoderPass, unsupported_encoder_reason
from fairseq_fastgen.engine.fairseq_runner import encoder_output
from fairseq_fastgen.engine.runners import StaticRunner, shared_by_beams
from fairseq_fastgen.engine.fused_weights import FusedWeights, FusedWeightsCache, tensors_signature
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.ops.onednn_linear import onednn_available, onednn_linear, onednn_serves, pack_weight

POSITION_BUCKET = 32  # target positions of a row bucket's buffers: this, doubled as rows grow past it
# target positions the buffers of the step for many rows grow by: that step reads every position of them (the
# unwritten ones masked), and at 320 rows buffers of 32 positions for rows at 10 read 3x the keys/values needed
POSITION_STEP = 8
SOURCE_BUCKET = 16  # source positions of the encoder-decoder keys: a multiple of this
# more rows than this run the step for every row count (or, where it cannot be built, the eager step with oneDNN's
# products): a bucket's compiled step beats the eager step with oneDNN's products at 1 and 2 rows, not from 4 rows
# (benchmarks/decoder_step_cost.py --compiled-max-rows 1000, and 0)
COMPILED_MAX_ROWS = 2
# with --compiled-freezing: the frozen step beats the eager fast form up to 4 rows, not at 8
FROZEN_MAX_ROWS = 4
# on CUDA every row count up to this is padded to a power of two and compiled, its row dimension symbolic (one
# compilation), each bucket replayed as a CUDA graph: a step of a small model there is bound by its kernel launches,
# not by the padding rows
CUDA_MAX_ROWS = 512
MAX_BUCKETS = 64  # compiled shapes kept per process
logger = logging.getLogger("fairseq_fastgen.engine")


def row_bucket(rows: int, max_rows: int) -> int:
    """The compiled row count for ``rows`` real rows: the next power of two (rows itself when eager, above
    ``max_rows``)."""
    if rows > max_rows or rows == 0:
        return rows
    return 1 << max(rows - 1, 0).bit_length()


def bucket_capacity(length: int) -> int:
    """Target positions of a row bucket's buffers for rows of ``length`` positions: ``POSITION_BUCKET`` times
    the smallest power of two that holds them (32, 64, 128, ...), so that a decode meets few bucket shapes."""
    return POSITION_BUCKET << (round_up(length, POSITION_BUCKET) // POSITION_BUCKET - 1).bit_length()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class CompiledRunner(StaticRunner):
    engine = "compiled"

    def __init__(self, model, temperature: float = 1.0, projection=None, freezing: bool = False, beams: int = 1,
                 background: bool = False):
        # beams: above max_rows, on the CPU, the step for many rows reads keys/values held once per sentence
        super().__init__(model, temperature, projection, beams=beams)
        self._compiled_step = None  # made on first use: torch.compile loads dynamo and inductor (much memory)
        self.compiled_shapes: Dict[Tuple[int, int, int], float] = {}  # bucket -> seconds of its first call
        self.compile_seconds = 0.0  # every first call of a bucket, recompilations after a weight change included
        # --compiled-freezing: the weights are constants of the compiled code (inductor's freezing and its C++
        # products for a few rows); it is compiled again when any decoder parameter changes
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.on_cuda = next(model.parameters()).device.type == "cuda"
        self.freezing = freezing and on_cpu
        self.frozen_signature = None  # the decoder parameters (identity, version) the compiled code holds
        # on the CPU, steps compiled ahead of time and kept on disk (aot_step.py): above max_rows one for every row
        # count (key None; ("beams", n) for sentences of n beams sharing their encoder-decoder keys), with
        # --compiled-freezing one per row bucket (key: its rows); a key is absent until a decode first needs it,
        # None where it could not be built (then eager, or torch.compile for a bucket)
        self.many_rows_on_cpu = on_cpu and onednn_available()
        self.packaged_steps: Dict[object, object] = {}
        self.compiled_now: set = set()  # keys of the packages compiled in this process (the others were loaded)
        # --compile-in-background: a step compiled ahead of time that is not on disk yet is compiled by a child
        # process (aot_step.BackgroundCompilation) while those steps run eager; one at a time, in the order needed
        self.compile_in_background = background
        self.background = None  # (key, what, BackgroundCompilation) of the package being compiled, or None
        # the largest row bucket
        self.max_rows = CUDA_MAX_ROWS if self.on_cuda else FROZEN_MAX_ROWS if self.freezing else COMPILED_MAX_ROWS
        # on CUDA one compilation with symbolic shapes serves every bucket (a CUDA graph is recorded per bucket)
        self.symbolic_buckets = self.on_cuda
        self.fused_weights = FusedWeightsCache(model.decoder)
        self.fused: Optional[FusedWeights] = None  # of the decode running now (start_cache)
        # the products of the encoder and of the eager step (None: torch's own, on CUDA)
        self.eager_linears = OneDNNLinears(model) if on_cpu and onednn_available() else None
        # on the CPU the encoder runs a unit compiled ahead of time where it can (encoder_pass.py)
        self.encoder_pass = None
        self.encoder_signature = None  # the encoder parameters (identity, version) its units hold
        if self.many_rows_on_cpu and unsupported_encoder_reason(model.encoder) is None:
            self.encoder_pass = EncoderPass(model.encoder)
        self.qkv_packed_from: Optional[FusedWeights] = None  # the fused weights qkv_packed holds, packed
        self.qkv_packed = []  # per layer: oneDNN's packed fused query/key/value weight (None: torch's product)
        self.block_width = 1  # positions per row of the widest block step_block ran: shorter ones are padded to it
        # a block unit also computes the log-probabilities of its features: those of head 1 where head 1 is the
        # base output (an identity-first k-head decoder), with the model's own projection
        heads = getattr(model.decoder, "heads", None)
        self.scores_blocks = projection is None and bool(getattr(heads, "identity_first", False))

    @property
    def compiled_step(self):
        """``padded_lprobs`` through ``torch.compile``; a decode that never runs ``max_rows`` rows or fewer never
        loads it."""
        if self._compiled_step is None:
            # one compiled graph per bucket: room for every bucket of a long decode (dynamo's default is 8)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_BUCKETS)
            # frozen weights: a copy of the method with its own code object, since torch.compile keeps compiled
            # code per code object and code compiled for older weights (as constants) must not be reused
            step = own_code(self.frozen_lprobs) if self.freezing else self.padded_lprobs
            options = inductor_options(self.model, self.symbolic_buckets)
            self._compiled_step = torch.compile(step, dynamic=self.symbolic_buckets, fullgraph=True, options=options)
        return self._compiled_step

    def eager_products(self):
        """The context in which eager work computes its products: oneDNN's on the CPU."""
        return self.eager_linears.attached() if self.eager_linears else contextlib.nullcontext()

    def encode(self, net_input):
        """fairseq's encoder output; on the CPU through a unit compiled ahead of time (one for a row, one for
        any more rows), fairseq's own encoder (oneDNN's products) where it cannot be built."""
        src_tokens = net_input["src_tokens"]
        unit = self.encoder_unit(src_tokens.size(0)) if self.encoder_pass is not None else None
        if unit is None:
            with self.eager_products():
                return super().encode(net_input)
        # contiguous: the unit reads its inputs at the strides it was compiled for (a subset's are a slice's)
        states, padding = unit(src_tokens.contiguous(), self.encoder_pass.position_table(src_tokens.size(1)))
        lengths = (~padding).sum(dim=1, dtype=torch.int32).reshape(-1, 1)  # (rows, 1), as fairseq's encoder's
        return encoder_output(states, padding, fc_results=[], src_lengths=[lengths])

    def encoder_unit(self, rows: int):
        """The encoder compiled ahead of time for ``rows`` rows (1, or any more), or None."""
        key = ("encoder", 1 if rows == 1 else None)
        signature = tensors_signature(self.model.encoder.parameters())
        if signature != self.encoder_signature:  # units holding other weights as constants: dropped
            self.encoder_signature = signature
            for unit in [("encoder", 1), ("encoder", None)]:
                self.packaged_steps.pop(unit, None)
        if key in self.packaged_steps:
            return self.packaged_steps[key]
        if self.compile_in_background:
            if self.background is not None:
                return self.background_step(key)
            if not any(step is not None for unit, step in self.packaged_steps.items() if not is_encoder(unit)):
                return None  # the steps' units first: a decode spends more on its steps than on its encoder
        from fairseq_fastgen.engine import aot_step

        what = f"the encoder for {'one row' if rows == 1 else 'more rows'}"
        return self.packaged(key, what, lambda: aot_step.EncoderPackage(self, key[1]))

    # ---- cache: rows padded to the bucket ---------------------------------------------------------
    @staticmethod
    def new_cache(capacity: int = 0) -> StaticCache:
        # grown by each step to the capacity its form reads (bucket_capacity, or POSITION_STEP at a time for many
        # rows); zeroed before its first compiled step (zero_unwritten)
        return StaticCache(POSITION_STEP)

    def reorder_cache(self, cache: StaticCache, index: Tensor):
        if cache.started:
            cache.select(padded_index(index, self.max_rows))
            cache.real_rows = index.numel()

    def concat_caches(self, caches):
        if not any(c.started for c in caches):
            return StaticCache(max(c.capacity for c in caches))
        if any(c.beams > 1 for c in caches):  # only fairseq's beam search shares keys, and it never merges caches
            raise ValueError("caches holding encoder-decoder keys per sentence cannot be merged (a bug)")
        for cache in caches:  # drop each part's padding rows before they end up between real rows
            if cache.self_keys[0].size(0) != cache.real_rows:
                cache.select(torch.arange(cache.real_rows, device=cache.cross_keys[0].device))
        merged = StaticRunner.concat_caches(caches)
        rows = sum(c.real_rows for c in caches)
        merged.select(padded_index(torch.arange(rows, device=merged.cross_keys[0].device), self.max_rows))
        merged.real_rows = rows
        return merged

    @staticmethod
    def widen_cache(cache: StaticCache, src_len: int, extra: int):
        if cache.started:
            width = cache.cross_keys[0].size(2)
            if src_len + extra > width:
                cache.widen_source(round_up(src_len + extra, SOURCE_BUCKET) - width)

    @staticmethod
    def narrow_cache(cache: StaticCache, width: int):
        if cache.started:
            cache.narrow_source(round_up(width, SOURCE_BUCKET))

    def start_cache(self, cache: StaticCache, encoder_out):
        """The encoder-decoder keys of the rows, padded to the row and source buckets; the fused weights
        as the parameters are now (once per decode; a cache started already keeps its keys)."""
        if cache.started:
            return
        self.fused = self.fused_weights.current()
        if self.freezing or self.many_rows_on_cpu:
            signature = tensors_signature(self.model.decoder.parameters())
            if signature != self.frozen_signature:  # compiled code holding other weights as constants: drop it
                self.frozen_signature, self.background = signature, None
                # the encoder's units stay: they follow the encoder's own parameters (encoder_unit)
                self.packaged_steps = {key: unit for key, unit in self.packaged_steps.items() if is_encoder(key)}
                self.decoder_step.fused_buffers = FusedBuffers(self.fused)  # a submodule: its buffers freeze
                if self.freezing:
                    self._compiled_step, self.compiled_shapes = None, {}
        states = encoder_out["encoder_out"][0]  # (src_len, rows, dim)
        src_len, rows = states.size(0), states.size(1)
        masks = encoder_out["encoder_padding_mask"]
        mask = masks[0] if masks else states.new_zeros((rows, src_len), dtype=torch.bool)
        width = round_up(src_len, SOURCE_BUCKET)
        states = F.pad(states, (0, 0, 0, 0, 0, width - src_len))
        mask = F.pad(mask, (0, width - src_len), value=True)
        index = padded_index(torch.arange(rows, device=states.device), self.max_rows)
        origin = StaticCache.row_origins(states, mask).index_select(0, index)
        beams = self.beams if self.shares_encoder_keys(origin, cache) else 1
        if beams > 1:
            index = index[::beams]  # each sentence's first beam: its keys serve all its beams
        with self.eager_products():
            keys, values = self.decoder_step.encoder_keys_values(states.index_select(1, index))
        keys, values = [k.contiguous() for k in keys], [v.contiguous() for v in values]  # the strides after a select
        cache.start(keys, values, mask.index_select(0, index), self.decoder_step.heads, self.decoder_step.head_dim,
                    origin, beams)
        cache.real_rows = rows

    def shares_encoder_keys(self, origin: Tensor, cache: StaticCache) -> bool:
        """Whether a cache whose rows' encoder states have ``origin`` (rows,) holds its encoder-decoder keys once
        per sentence: the rows are sentences of ``beams`` equal rows each (fairseq's beam search), more than
        the row buckets take, and the step that reads them is compiled (on the CPU)."""
        beams = self.beams
        if beams <= self.max_rows or not self.many_rows_on_cpu or not shared_by_beams(origin, beams):
            return False
        return self.packaged_step(None, cache, beams) is not None

    # ---- one decoder step ---------------------------------------------------------------------------
    @property
    def many_rows_step(self):
        """The step for every row count above ``max_rows`` (None until built, or where it could not be)."""
        return self.packaged_steps.get(None) or self.packaged_steps.get(("beams", self.beams))

    def step(self, tokens: Tensor, encoder_out, cache: StaticCache):
        if not cache.started:
            self.start_cache(cache, encoder_out)
        unit = self.padded_unit(tokens.size(0), cache)
        if unit is None:
            return self.eager_step(tokens, encoder_out, cache)
        positions = tokens.new_full((tokens.size(0),), tokens.size(1) - 1)  # every row at the prefix's length
        return self.padded_step(unit, tokens[:, -1:], positions, encoder_out, cache)

    def step_rows(self, last_tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """As ``ModelRunner.step_rows`` (rows joined at different lengths): the padded step, each row at its own
        position and attending only its own positions (eager with oneDNN's products where no unit serves)."""
        if not cache.started:
            self.start_cache(cache, encoder_out)
        unit = self.padded_unit(last_tokens.size(0), cache)
        if unit is None:
            with self.eager_products():
                return super().step_rows(last_tokens, positions, encoder_out, cache)
        return self.padded_step(unit, last_tokens, positions, encoder_out, cache)

    def padded_unit(self, rows: int, cache: StaticCache):
        """What runs the padded step of ``rows`` rows: above ``max_rows`` the unit for every row count (None
        where it cannot be built, or off the CPU: eager), else the rows' bucket (its frozen unit with
        --compiled-freezing, or torch.compile's)."""
        if rows > self.max_rows:
            return self.packaged_step(None, cache, cache.beams) if self.many_rows_on_cpu else None
        if self.freezing and self.many_rows_on_cpu:
            bucket = cache.self_keys[0].size(0)  # the rows, padded
            packaged = self.packaged_step(bucket, cache)
            if packaged is not None:
                return packaged
            if bucket not in self.packaged_steps:  # compiled in the background: the same form, eager, till then
                return self.eager_padded_step
        return lambda *inputs: self.compiled_bucket_step(inputs, cache)

    def eager_padded_step(self, *inputs):
        """The padded step of a bucket whose unit a child process compiles: uncompiled, oneDNN's products."""
        with self.eager_products():
            return self.padded_lprobs(*inputs, self.fused)

    def padded_step(self, unit, last_tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """lprobs (rows, vocab) and attention (rows, src_len) of ``unit``'s step: last_tokens (rows, 1) at
        target ``positions`` (rows,), their keys/values written at the buffers' length."""
        lprobs, attn = self.run_padded(unit, last_tokens, positions, cache)
        attn = attn[:, : encoder_out["encoder_out"][0].size(0)]
        if self.on_cuda:  # the outputs of a CUDA graph live in its memory pool, rewritten by its next replay
            lprobs, attn = lprobs.clone(), attn.clone()
        if self.projection is not None:
            lprobs = self.lprobs(lprobs)
        return lprobs, attn

    def run_padded(self, unit, tokens: Tensor, positions: Tensor, cache: StaticCache):
        """``unit``'s first two outputs for the real rows, after writing its new keys/values at the buffers'
        length: tokens (rows, n) at target ``positions`` ((rows,) for one position, else (rows, n))."""
        rows, written, n = tokens.size(0), cache.length, tokens.size(1)
        if rows > self.max_rows:  # its capacity is symbolic: buffers a little longer than the rows need
            room = round_up(written + n, POSITION_STEP)
            if cache.capacity >= room + 2 * POSITION_STEP:  # positions dropped at the front (streams)
                cache.shrink_room(room)
            cache.ensure_room(room, doubling=False)
        else:
            cache.ensure_room(bucket_capacity(written + n), doubling=False)
        cache.zero_unwritten()  # the padded step reads every position, the unattended ones masked
        cache.attended_padding(n)  # the new positions are no row's padding (a released row's dropped ones were)
        rows_index = padded_index(torch.arange(rows, device=tokens.device), self.max_rows)
        inputs = (tokens.index_select(0, rows_index), positions.index_select(0, rows_index),
                  cache.attended(), self.decoder_step.position_table(cache.capacity), cache.self_keys,
                  cache.self_values, cache.cross_keys, cache.cross_values, cache.cross_mask)
        outputs, attn, new_keys, new_values = unit(*inputs)  # outputs: a tensor, or a list of them
        for buffer, new in zip(cache.self_keys + cache.self_values, new_keys + new_values):
            if n == 1:
                buffer[:, :, written] = new  # (rows, heads, head_dim) at the buffers' length
            else:
                buffer[:, :, written: written + n] = new  # (rows, heads, n, head_dim)
        cache.length = written + n
        if isinstance(outputs, (list, tuple)):
            return [output[:rows] for output in outputs], attn[:rows]
        return outputs[:rows], attn[:rows]

    def eager_step(self, tokens: Tensor, encoder_out, cache: StaticCache):
        """A step of more than ``max_rows`` rows without a compiled unit: the fast form (the exact form over
        rows holding left padding), products through oneDNN on the CPU."""
        # the eager forms never read unwritten positions: keeping them zero (a memset of most of every buffer
        # at each beam reorder) would be work for nothing; the next compiled step zeroes them again
        cache.zeroed = False
        with self.eager_products():
            form = self.decoder_step.exact if cache.self_padding is not None else self.fast_form
            features, attn = self.next_position(tokens, encoder_out, cache, form)
            lprobs = self.lprobs(features)
        return lprobs, attn[:, -1, : encoder_out["encoder_out"][0].size(0)]

    def compiled_bucket_step(self, inputs, cache: StaticCache):
        """The step of a row bucket through torch.compile (one compilation per bucket and process)."""
        shape = (cache.self_keys[0].size(0), cache.capacity, cache.cross_keys[0].size(2))
        start = time.perf_counter()
        with self.compile_settings(shape):
            if self.on_cuda:  # a new replay may overwrite the outputs of the last one: step() has copied them
                torch.compiler.cudagraph_mark_step_begin()
            outputs = self.compiled_step(*inputs, self.fused)
        if shape not in self.compiled_shapes:
            self.compiled_shapes[shape] = time.perf_counter() - start
            self.compile_seconds += self.compiled_shapes[shape]
            # a bucket served by code compiled for another (symbolic shapes) or found in inductor's cache: no news
            seconds = self.compiled_shapes[shape]
            logger.log(logging.INFO if seconds >= 1.0 else logging.DEBUG,
                       f"--step-engine compiled: step for {shape[0]} rows, {shape[1]} target and {shape[2]} "
                       f"source positions compiled in {seconds:.1f} s")
        return outputs

    def packaged_step(self, rows: Optional[int], cache: StaticCache, beams: int = 1, block: int = 1):
        """The step compiled ahead of time for ``rows`` rows (None: every row count above ``max_rows``; with
        ``beams`` > 1, sentences of that many beams sharing their encoder-decoder keys; with ``block`` > 1,
        that many positions per row), loaded from disk or compiled the first time a decode needs it (with
        --compile-in-background: by a child process, None until it is ready); None where it cannot be built
        (one line says why)."""
        key = ("block", block, rows) if block > 1 else rows if beams == 1 else ("beams", beams)
        if key in self.packaged_steps:
            return self.packaged_steps[key]
        if self.compile_in_background:
            if self.background is not None:  # polled at every step while a child compiles: nothing built before
                return self.background_step(key)
            if key is None and self.beams > self.max_rows:
                return None  # beam search: only its sentences' unit is compiled; rows not laid out so run eager
        from fairseq_fastgen.engine import aot_step

        what = f"the step above {self.max_rows} rows" if rows is None else f"the step of {rows} rows"
        if block > 1:
            what = what.replace("the step", f"the step of {block} positions per row")
        if beams > 1:
            what += f" ({beams} beams a sentence, sharing its encoder-decoder keys)"
        table = self.decoder_step.position_table(cache.capacity)
        return self.packaged(key, what, lambda: aot_step.StepPackage(self, table, rows, beams, block))

    def packaged(self, key, what: str, package):
        """The unit ``package()`` describes (an ``aot_step`` package), loaded or compiled (with
        --compile-in-background and no child compiling: by a child process, None until it is ready; the callers
        poll a running child first); None where it cannot be built (one line says why)."""
        from fairseq_fastgen.engine import aot_step

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
            step, seconds, compiled_now = aot_step.load_or_compile(package)
        except Exception as error:  # export or inductor refusing this model: eager, or torch.compile, serves it
            return self.not_compiled(key, what, error)
        return self.keep_packaged_step(key, what, step, seconds, compiled_now)

    def background_step(self, key):
        """The step the child process compiles, once it is ready (polled); None before, and for every other
        step while one is compiled in the background (they run eager; the next is compiled after it)."""
        compiling, what, compilation = self.background
        if key != compiling:
            return None
        try:
            ready = compilation.ready()  # (step, seconds) or None
        except Exception as error:
            self.background = None
            return self.not_compiled(key, what, error)
        if ready is None:
            return None
        self.background = None
        return self.keep_packaged_step(key, what + " (in the background)", *ready, compiled_now=True)

    def not_compiled(self, key, what: str, error: Exception):
        self.packaged_steps[key] = None
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        fallback = ("torch.compile compiles it" if isinstance(key, int) else "fairseq's encoder runs" if is_encoder(key)
                    else "those steps run eager")
        logger.warning(f"--step-engine compiled: {what} could not be compiled ahead of time ({reason}); {fallback}")
        return None

    def keep_packaged_step(self, key, what: str, step, seconds: float, compiled_now: bool):
        self.packaged_steps[key] = step
        self.compile_seconds += seconds
        if isinstance(key, int):
            self.compiled_shapes[(key, None, None)] = seconds
        if compiled_now:
            self.compiled_now.add(key)
        from fairseq_fastgen.engine.aot_step import compiled_dir

        done = "compiled and stored" if compiled_now else "loaded"
        logger.info(f"--step-engine compiled: {what} {done} in {seconds:.1f} s ({compiled_dir()})")
        return step

    def compile_settings(self, shape):
        """Inductor's settings around a call that compiles a new bucket: with --compiled-freezing the weights
        become constants of the compiled code (inductor reads ``freezing`` before a torch.compile call's own
        options apply) and their products take its C++ GEMM template, faster at one row at the price of a longer
        compilation per bucket.  With symbolic shapes
        every input dimension gets a symbol of its own: dynamo would otherwise give one symbol to dimensions
        that happen to be equal at the first call (64 rows and a head of 64 values) and compile again once
        they differ."""
        if shape in self.compiled_shapes or not (self.freezing or self.symbolic_buckets):
            return contextlib.nullcontext()
        if self.symbolic_buckets:
            import torch.fx.experimental._config

            return torch.fx.experimental._config.patch(use_duck_shape=False)
        import torch._inductor.config

        return torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")

    def fast_form(self, last_tokens: Tensor, position_rows, cache: StaticCache):
        """The decoder step's fast form, its fused query/key/value products through oneDNN where it serves."""
        if self.qkv_packed_from is not self.fused:  # the decode's fused weights: packed once per change
            self.qkv_packed_from = self.fused
            with_onednn = self.eager_linears is not None
            self.qkv_packed = [pack_weight(w) if with_onednn else None for w in self.fused.qkv_weights]
        fused, packed = self.fused, self.qkv_packed

        def qkv_product(index: int, x: Tensor) -> Tensor:
            weight, bias = fused.qkv_weights[index], fused.qkv_biases[index]
            if packed[index] is not None and onednn_serves(x, weight):
                return onednn_linear(x, packed[index], bias)
            return F.linear(x, weight, bias)

        return self.decoder_step.fast(last_tokens, position_rows, cache, qkv_product)

    def step_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """Several positions per row (blockwise verification): base features (rows, n, dim) and attention
        (rows, n, src_len) from the padded step of a block of positions, a unit compiled ahead of time on
        the CPU (above ``max_rows`` rows, and with --compiled-freezing each row bucket's); elsewhere the exact
        form, eager with oneDNN's products.  A shorter block (the bos, a row near its length limit) runs in
        the widest block's unit, padded at its end: its positions attend none of the padding's, whose keys
        and values are dropped after the call."""
        return self.block_pass(tokens, positions, encoder_out, cache)[:2]

    def step_block_scored(self, tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """As ``ModelRunner.step_block_scored``: a block unit computes the log-probabilities in the same call
        (with the model's own projection)."""
        features, attn, lprobs = self.block_pass(tokens, positions, encoder_out, cache)
        return features, attn, self.project(features.contiguous()) if lprobs is None else lprobs

    def block_pass(self, tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """``step_block``'s features and attention, and the log-probabilities of the features where a unit
        computed them (else None)."""
        if not cache.started:
            self.start_cache(cache, encoder_out)
        (rows, n), src_len = tokens.shape, encoder_out["encoder_out"][0].size(0)
        width = max(self.block_width, n)
        unit = self.block_unit(rows, width, cache)
        if unit is not None:
            self.block_width = width
            if width > n:  # the padding repeats the last token at the last position
                tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, width - n)], dim=1)
                positions = torch.cat([positions, positions[:, -1:].expand(-1, width - n)], dim=1)
            outputs, attn = self.run_padded(unit, tokens, positions, cache)
            cache.drop_last(width - n)
            features, lprobs = outputs if self.scores_blocks else (outputs, None)
            return features[:, :n], attn[:, :n, :src_len], None if lprobs is None else lprobs[:, :n]
        rows_index = padded_index(torch.arange(rows, device=tokens.device), self.max_rows)  # the cache's rows
        with self.eager_products():
            features, attn = super().step_block(tokens.index_select(0, rows_index),
                                                positions.index_select(0, rows_index), encoder_out, cache)
        return features[:rows], attn[:rows, :, :src_len], None

    def block_unit(self, rows: int, block: int, cache: StaticCache):
        """The unit compiled ahead of time for ``block`` positions per row of ``rows`` rows, or None (eager)."""
        if block == 1 or not self.many_rows_on_cpu or cache.beams > 1:
            return None
        if rows > self.max_rows:
            return self.packaged_step(None, cache, block=block)
        if self.freezing:
            return self.packaged_step(cache.self_keys[0].size(0), cache, block=block)
        return None

    def keep_accepted(self, cache: StaticCache, accepted: Tensor):
        rows_index = padded_index(torch.arange(accepted.size(0), device=accepted.device), self.max_rows)
        cache.keep_accepted(accepted.index_select(0, rows_index))

    def padded_lprobs(self, last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys,
                      cross_values, cross_mask, fused: FusedWeights, beams: int = 1):
        """The compiled unit: the padded step and, with the full projection, log-softmax of its logits."""
        features, attn, new_keys, new_values = self.decoder_step.padded(
            last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys, cross_values,
            cross_mask, fused.qkv_weights, fused.qkv_biases, beams,
        )
        if self.projection is not None:  # a cluster projection runs eager, after the step
            return features, attn, new_keys, new_values
        return self.log_softmax(features, fused)[:, -1, :], attn, new_keys, new_values

    def log_softmax(self, features, fused: FusedWeights):
        """Log-probabilities (rows, n, vocab) of features (rows, n, dim): the model's projection (its weight
        transposed), the temperature, log-softmax."""
        if fused.output_t is not None:
            logits = torch.matmul(features, fused.output_t)  # (rows, n, vocab)
        else:
            logits = self.model.decoder.output_layer(features)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return F.log_softmax(logits.float(), dim=-1)

    def padded_block(self, last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys,
                     cross_values, cross_mask, fused: FusedWeights, beams: int = 1):
        """The compiled unit of several positions per row: the padded step's base features (no head: blockwise
        decoding applies its heads to them) and, where ``scores_blocks``, [features, their log-probabilities]
        (rows, n, vocab); attention and new keys/values."""
        features, attn, new_keys, new_values = self.decoder_step.padded(
            last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys, cross_values,
            cross_mask, fused.qkv_weights, fused.qkv_biases, beams, first_head=False,
        )
        if self.scores_blocks:
            features = [features, self.log_softmax(features, fused)]
        return features, attn, new_keys, new_values

    def frozen_lprobs(self, *inputs):
        """``padded_lprobs`` reading the fused weights from the buffers of a submodule of the decoder step
        instead of its last input: inductor's freezing then folds them, with the model's parameters, into the
        compiled code (tensors reached otherwise stay inputs)."""
        return self.padded_lprobs(*inputs[:-1], self.decoder_step.fused_buffers.weights())

    def statistics(self) -> dict:
        """For the decoder's statistics: the buckets this runner met and the seconds of their first calls
        (their compilation, or its load from inductor's on-disk cache)."""
        packaged = sum(1 for key, step in self.packaged_steps.items()
                       if step is not None and not isinstance(key, int) and not is_encoder(key))
        buckets = len(self.compiled_shapes) + packaged  # the units above the buckets, and the block units
        return {"compiled_buckets": buckets, "compile_seconds": round(self.compile_seconds, 2)}


class FusedBuffers(nn.Module):
    """:class:`FusedWeights` as the buffers of a module, where torch.compile's freezing reads constants."""

    def __init__(self, fused: FusedWeights):
        super().__init__()
        self.layers = len(fused.qkv_weights)
        for index, (weight, bias) in enumerate(zip(fused.qkv_weights, fused.qkv_biases)):
            self.register_buffer(f"qkv_weight_{index}", weight)
            self.register_buffer(f"qkv_bias_{index}", bias)
        self.register_buffer("output_t", fused.output_t)

    def weights(self) -> FusedWeights:
        return FusedWeights([getattr(self, f"qkv_weight_{i}") for i in range(self.layers)],
                            [getattr(self, f"qkv_bias_{i}") for i in range(self.layers)], self.output_t)


def is_encoder(key) -> bool:
    """Whether a key of ``CompiledRunner.packaged_steps`` is an encoder unit's."""
    return isinstance(key, tuple) and key[0] == "encoder"


def own_code(method):
    """``method`` bound again to a copy of its function with a code object of its own."""
    function = method.__func__
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def padded_index(index: Tensor, max_rows: int) -> Tensor:
    """``index`` followed by repeats of its first entry up to the row bucket; (row_bucket(n, max_rows),)."""
    bucket = row_bucket(index.numel(), max_rows)
    if bucket == index.numel():
        return index
    return torch.cat([index, index[:1].expand(bucket - index.numel())])


def inductor_options(model, symbolic: bool) -> dict:
    on_cpu = next(model.parameters()).device.type == "cpu"
    options = {"cpp_wrapper": True} if on_cpu else {"triton.cudagraphs": True}
    # only the inputs' shapes, dtypes and strides choose a compiled bucket: the model, the temperature and the
    # projection of a runner never change, and checking their guards is a visible share of a one-row step
    # (each torch.compile call keeps its own compiled code, so another runner's model is never mistaken for it)
    # (with symbolic shapes the guards relating them to each other stay)
    if not symbolic:
        options["guard_filter_fn"] = torch.compiler.keep_tensor_guards_unsafe
    return options
