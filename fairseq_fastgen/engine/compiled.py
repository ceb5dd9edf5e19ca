"""``--step-engine compiled``: the runner of the compiled decoder step, and its cache's bookkeeping.

A compiled step is read in three files:

* ``decoder_step.py``: the decoder step, one layer loop; its padded form (``DecoderStep.padded``) reads
  buffers of fixed shapes, every row at its own position, and ``compiled_step.PaddedStep`` adds its scores;
* ``compiled_units.py``: which callable runs a step of a given shape (a row bucket through torch.compile,
  a unit compiled ahead of time and kept on disk, one compiled in the background, or none: eager);
* this runner: the cache laid out as the units read it, and the step's route through them.

A decode meets few shapes: the cache of a state holds its rows padded up to a row bucket (1 or 2 rows,
up to ``frozen_max_rows`` with --compiled-freezing; the padding rows repeat row 0 and are never read back),
its target positions up to ``POSITION_BUCKET`` times a power of two (``bucket_capacity``) and its source
positions up to a multiple of ``SOURCE_BUCKET`` (masked).  Above the buckets, on the CPU, one unit compiled
ahead of time serves every row count (``aot_step.py``: its shapes symbolic, its weights frozen, oneDNN's
prepacked products), its buffers growing ``POSITION_STEP`` positions at a time.  Rows joined at different
lengths (``step_rows``: streaming refills) and rows holding left padding take the same units, each row
attending only its own positions (``StaticCache.attended``).  Blockwise verification (``step_block``) runs a
unit of its own for a block of positions per row, shorter blocks padded to the widest.  Where no unit serves,
the step runs eager in the decoder step's fast form (the exact form for blocks and left padding), its
products through oneDNN on the CPU (``ops/onednn_linear.py``).  With ``--compiled-many-rows static`` or ``kernel`` (the
default on processors without AVX-512, in float32) the one-position steps above the buckets run the static engine's
step instead, on this runner's cache: its exact form, torch's products or the plugin's float32 kernel's; no unit is
built for them.  Above the buckets a beam search's first step runs one row per sentence (``first_step_of_beams``:
its beams hold the same bos), as CTranslate2 starts a beam search, and its keys are copied to the beams.  On the CPU the
encoder runs a unit compiled ahead of time too (``encoder_pass.py``); with ``kernel`` its pass runs eager, through the
kernel's products, and so do the encoder-decoder keys.

On CUDA the row buckets go up to ``CUDA_MAX_ROWS`` rows (powers of two), all served by one compilation
whose shapes are symbolic, each bucket replayed as a CUDA graph: a step of a small model there costs its
kernel launches, not its padding rows.

The self-attention's query, key and value projections run as one product and the vocabulary projection
reads its weight transposed (``fused_weights.py``); the padded step sums its softmaxes over the whole buffer
and inductor fuses operations, so scores differ from fairseq's in the last bits: the tests hold the tokens
equal and the scores within 1e-4.
"""

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_fastgen.adapters.linear_forwards import F32RowsLinears, OneDNNLinears
from fairseq_fastgen.engine.compiled_step import PaddedStep
from fairseq_fastgen.engine.compiled_units import CompiledUnits
from fairseq_fastgen.engine.encoder_pass import EncoderPass, unsupported_encoder_reason
from fairseq_fastgen.engine.encoder_pass import int8_layers as encoder_int8_layers
from fairseq_fastgen.engine.fairseq_runner import encoder_output
from fairseq_fastgen.engine.runners import StaticRunner, shared_by_beams
from fairseq_fastgen.engine.fused_weights import (
    FusedWeights, FusedWeightsCache, encoder_key_value_projections, fused_linears,
)
from fairseq_fastgen.engine.bf16_weights import Bf16Weights
from fairseq_fastgen.engine.int8_weights import Int8Layer, Int8Weights, takes_int8
from fairseq_fastgen.engine.layer_weights import LayerWeights
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.ops.f32_rows_linear import many_rows_kernel_available
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
# with --compiled-freezing, a runner of one row per sentence and one position per row (greedy, the streams, the
# plugin's own beam searches; not a k-head model's, which verifies blocks): its frozen buckets go up to this. With
# the kernel's one pass of 8 rows a bucket of 8 took 10.9 ms a step at 8 rows against 14.0 for the step above the
# buckets (5-6 rows: the same; untrained base shapes, Zen 5; benchmarks/decoder_step_cost.py --compiled-max-rows)
FROZEN_MAX_ROWS = 8
# and the other runners up to the smaller of this and FROZEN_MAX_ROWS: fairseq's beam search (its sentences' beams
# share their encoder-decoder keys), where at 8 beam 5 at one sentence (5 rows) ran padded to 8 instead of its
# beams' unit, 3.2 against 3.3-3.8 sentences/s; and a k-head model's, whose blocks of 5-8 rows are more product rows
# than the kernel's one pass
FROZEN_MAX_ROWS_OTHERS = 4
# on CUDA every row count up to this is padded to a power of two and compiled, its row dimension symbolic (one
# compilation), each bucket replayed as a CUDA graph: a step of a small model there is bound by its kernel launches,
# not by the padding rows
CUDA_MAX_ROWS = 512


def frozen_max_rows(beams: int, blocks: bool) -> int:
    """The largest frozen row bucket of a runner whose sentences hold ``beams`` rows each (``blocks``: of a k-head
    model, which verifies blocks of positions)."""
    return FROZEN_MAX_ROWS if beams == 1 and not blocks else min(FROZEN_MAX_ROWS, FROZEN_MAX_ROWS_OTHERS)


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
    # the units pad rows to their own buckets: a finished row kept costs a step its row (at 20 requests/s a served
    # stream of ~2 sentences stepped 4 rows, 2.6 ms a step where 2 rows take 2.0)
    kept_row_multiple = 1

    def __init__(self, model, temperature: float = 1.0, projection=None, freezing: bool = False, beams: int = 1,
                 background: bool = False, precision: Optional[str] = None, many_rows: str = "unit"):
        # beams: above max_rows, on the CPU, the step for many rows reads keys/values held once per sentence
        # int8: a block's positions run as rows of one position (block_rows.py), so blockwise's exact mode is greedy
        by_position = precision in ("int8", "int8-layers")
        super().__init__(model, temperature, projection, blocks_by_position=by_position, beams=beams)
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.on_cuda = next(model.parameters()).device.type == "cuda"
        # --quantize: "int8", "int8-layers" (the vocabulary projection float32) or "bf16": the units compute the
        # decoder's linear layers in that precision, constants of every unit (int8_weights.py, bf16_weights.py), so
        # every unit is frozen; in int8 the encoder's unit holds its layers' int8 rows too (encoder_pass.py) and the
        # encoder-decoder keys are one int8 product (encoder_keys_product); in bf16 the encoder and those keys run
        # fairseq's layers, through --quantize's stand-ins
        self.precision = precision if on_cpu else None
        # --compiled-freezing: the weights are constants of the compiled code (inductor's freezing and its C++
        # products for a few rows); it is compiled again when any decoder parameter changes
        self.freezing = (freezing or self.precision is not None) and on_cpu
        # --compiled-many-rows static or kernel (on the CPU, in float32): a one-position step of more rows than
        # max_rows runs the static engine's step (its exact form, the logits in aligned rows), no unit for it
        self.static_many_rows = many_rows in ("static", "kernel") and on_cpu and self.precision is None
        # --compiled-many-rows kernel: that step's products through the plugin's float32 kernel, on the frozen
        # units' copies of the weights in its layout where they hold them
        self.kernel_linears = (F32RowsLinears(model.decoder, self.units_kernel_layout)
                               if self.static_many_rows and many_rows == "kernel" and many_rows_kernel_available()
                               else None)
        # and a beam search's beams of a sentence attend to its keys in one product (not torch's bits anyway)
        self.decoder_step.beams_together = self.kernel_linears is not None
        # and the encoder: its pass (encoder_pass.py) eager, a batch's source positions the rows of the kernel's
        # products (on a Zen 3: 1.03x the compiled unit at one sentence, 1.22-1.24x at 8 and 64,
        # benchmarks/encoder_paths.py), and the encoder-decoder keys through the kernel too; no encoder unit is built
        self.kernel_encoder: Optional[Tuple[EncoderPass, F32RowsLinears]] = None
        if self.kernel_linears is not None and unsupported_encoder_reason(model.encoder) is None:
            self.kernel_encoder = EncoderPass(model.encoder), F32RowsLinears(model.encoder)
        # on the CPU, steps compiled ahead of time and kept on disk (aot_step.py): above max_rows one for every row
        # count, with --compiled-freezing one per row bucket
        packages = on_cpu and onednn_available()
        heads = getattr(model.decoder, "heads", None)
        max_rows = (CUDA_MAX_ROWS if self.on_cuda else frozen_max_rows(beams, heads is not None) if self.freezing
                    else COMPILED_MAX_ROWS)
        self.fused_weights = FusedWeightsCache(model.decoder)
        self.fused: Optional[FusedWeights] = None  # of the decode running now (start_cache)
        # the products of the encoder and of the eager step (None: torch's own, on CUDA)
        self.eager_linears = OneDNNLinears(model) if on_cpu and onednn_available() else None
        self.qkv_packed_from: Optional[FusedWeights] = None  # the fused weights qkv_packed holds, packed
        self.qkv_packed = []  # per layer: oneDNN's packed fused query/key/value weight (None: torch's product)
        self.keys_rows_from: Optional[FusedWeights] = None  # the fused weights keys_rows was made with
        self.keys_rows: Optional[Int8Layer] = None  # under int8: every layer's encoder-decoder projections, one product
        self.block_width = 1  # positions per row of the widest block step_block ran: shorter ones are padded to it
        # a block unit also computes the log-probabilities of its features: those of head 1 where head 1 is the
        # base output (an identity-first k-head decoder), with the model's own projection
        self.scores_blocks = projection is None and bool(getattr(heads, "identity_first", False))
        step = PaddedStep(self.decoder_step, temperature, projection is None, self.scores_blocks)
        # on the CPU the encoder runs a unit compiled ahead of time where it can (encoder_pass.py)
        encoder_pass = None
        if (packages and unsupported_encoder_reason(model.encoder) is None and self.precision != "bf16"
                and self.kernel_encoder is None):
            encoder_pass = EncoderPass(model.encoder, None if self.precision is None else encoder_int8_layers)
        # --compile-in-background: a unit that is not on disk yet is compiled by a child process while its steps
        # run eager; on CUDA one compilation with symbolic shapes serves every bucket (a CUDA graph per bucket)
        self.units = CompiledUnits(step, encoder_pass, max_rows, self.freezing, packages, symbolic=self.on_cuda,
                                   background=background, eager_products=self.eager_products,
                                   reduced_weights=self.reduced_weights if self.precision else None,
                                   many_rows_units=not self.static_many_rows)

    def reduced_weights(self, fused: FusedWeights) -> LayerWeights:
        """The decoder's linear layers in ``self.precision`` (``fused``: its fused query/key/value weights)."""
        decoder = self.decoder_step.decoder
        if self.precision == "bf16":
            return Bf16Weights(decoder, fused.qkv_weights, fused.qkv_biases)
        return Int8Weights(decoder, fused.qkv_weights, fused.qkv_biases,
                           float32_vocabulary=self.precision == "int8-layers")

    def units_kernel_layout(self, linear: nn.Linear) -> Optional[Tensor]:
        """The kernel's layout of ``linear``'s current weight where the units of a few rows hold it, else None."""
        step = self.units.few_rows_step
        return None if step is None else step.reduced.packed(linear)

    @property
    def max_rows(self) -> int:
        """The largest row bucket: more rows run the step for every row count (or eager)."""
        return self.units.max_rows

    @property
    def many_rows_on_cpu(self) -> bool:
        """Whether steps are compiled ahead of time (on the CPU, where oneDNN serves)."""
        return self.units.packages

    def eager_products(self):
        """The context in which eager work computes its products: oneDNN's on the CPU."""
        return self.eager_linears.attached() if self.eager_linears else contextlib.nullcontext()

    def many_rows_products(self, rows: int):
        """The context of an eager step's products for ``rows`` rows: above max_rows with --compiled-many-rows
        static or kernel (the static engine's step) torch's own or the kernel's (``kernel_linears``), else
        ``eager_products``."""
        if not self.runs_static_step(rows):
            return self.eager_products()
        return self.kernel_linears.attached() if self.kernel_linears else contextlib.nullcontext()

    def runs_static_step(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is the static engine's (--compiled-many-rows static or kernel, above
        max_rows)."""
        return self.static_many_rows and rows > self.max_rows

    def encode(self, net_input):
        """fairseq's encoder output; on the CPU through a unit compiled ahead of time (one for a row, one for
        any more rows), fairseq's own encoder (oneDNN's products) where it cannot be built; with
        --compiled-many-rows kernel the encoder's pass with the kernel's products."""
        src_tokens = net_input["src_tokens"]
        if self.kernel_encoder is not None:
            encoder_pass, linears = self.kernel_encoder
            with linears.attached():
                return self.encoder_result(*encoder_pass(src_tokens, encoder_pass.position_table(src_tokens.size(1))))
        unit = self.units.encoder_unit(src_tokens.size(0))
        if unit is None:
            with self.eager_products():
                return super().encode(net_input)
        # contiguous: the unit reads its inputs at the strides it was compiled for (a subset's are a slice's)
        encoder_pass = self.units.encoder_pass
        return self.encoder_result(*unit(src_tokens.contiguous(), encoder_pass.position_table(src_tokens.size(1)),
                                         encoder_pass.token_table()))

    @staticmethod
    def encoder_result(states: Tensor, padding: Tensor):
        """fairseq's encoder output of an encoder pass's states (src_len, rows, dim) and padding (rows, src_len)."""
        lengths = (~padding).sum(dim=1, dtype=torch.int32).reshape(-1, 1)  # (rows, 1), as fairseq's encoder's
        return encoder_output(states, padding, fc_results=[], src_lengths=[lengths])

    # ---- cache: rows padded to the bucket ---------------------------------------------------------
    @staticmethod
    def new_cache(capacity: int = 0) -> StaticCache:
        # grown by each step to the capacity its form reads (bucket_capacity, or POSITION_STEP at a time for many
        # rows); zeroed before its first compiled step (zero_unwritten)
        return StaticCache(POSITION_STEP)

    @staticmethod
    def surviving_rows(finished: Tensor) -> Tensor:
        """The rows kept when rows ``finished`` (rows,) leave (rows - finished,): the last kept rows take the
        places of finished ones before them and the others stay in place, so the cache copies only the rows
        that move (``StaticCache.select``), not every kept row at every sentence's end.  A row's numbers do not
        depend on its place among the rows of a compiled step."""
        kept = (~finished).nonzero().squeeze(1)  # (kept,) in order
        places = torch.arange(kept.numel(), device=finished.device)
        holes = finished[: kept.numel()].nonzero().squeeze(1)  # finished rows among the first kept-count rows
        return places.index_copy_(0, holes, kept[kept.numel() - holes.numel():])  # the kept rows past them fill them

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
            self.units.follow_decoder_weights(self.fused)
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
        with self.kernel_linears.attached() if self.kernel_linears else self.eager_products():
            keys, values = self.decoder_step.encoder_keys_values(states.index_select(1, index),
                                                                 product=self.encoder_keys_product())
        keys, values = [k.contiguous() for k in keys], [v.contiguous() for v in values]  # the strides after a select
        cache.start(keys, values, mask.index_select(0, index), self.decoder_step.heads, self.decoder_step.head_dim,
                    origin, beams)
        cache.real_rows = rows

    def encoder_keys_product(self) -> Optional[Int8Layer]:
        """Under --quantize int8, every layer's encoder-decoder key and value projections as one product of int8 rows
        (``DecoderStep.encoder_keys_values``: one call a sentence instead of two a layer through the stand-ins, the
        same bits: an output row's int8 product does not depend on the rows beside it), made again with the fused
        weights, whose signature covers those projections; else None (each projection's own product)."""
        if self.precision not in ("int8", "int8-layers"):
            return None
        if self.keys_rows_from is not self.fused:
            projections = encoder_key_value_projections(self.decoder_step.decoder)
            int8 = len(projections) == 2 * len(self.decoder_step.layers) and all(map(takes_int8, projections))
            self.keys_rows = Int8Layer(*fused_linears(projections)) if int8 else None
            self.keys_rows_from = self.fused
        return self.keys_rows

    def shares_encoder_keys(self, origin: Tensor, cache: StaticCache) -> bool:
        """Whether a cache whose rows' encoder states have ``origin`` (rows,) holds its encoder-decoder keys once
        per sentence: the rows are sentences of ``beams`` equal rows each (fairseq's beam search), more than
        the row buckets take, and the step that reads them is the static engine's or a compiled one (on the CPU)."""
        beams = self.beams
        if beams <= self.max_rows or not shared_by_beams(origin, beams):
            return False
        if self.static_many_rows:
            return True
        return self.many_rows_on_cpu and self.units.package_unit(None, beams, 1, cache.capacity) is not None

    # ---- one decoder step ---------------------------------------------------------------------------
    @property
    def many_rows_step(self):
        """The step for every row count above ``max_rows`` (None until built, or where it could not be)."""
        return self.units.many_rows_unit(self.beams)

    def step(self, tokens: Tensor, encoder_out, cache: StaticCache):
        if not cache.started:
            self.start_cache(cache, encoder_out)
        if self.starts_beams_once(cache):
            return self.first_step_of_beams(tokens, encoder_out, cache)
        unit = self.padded_unit(tokens.size(0), cache)
        if unit is None:
            return self.eager_step(tokens, encoder_out, cache)
        positions = tokens.new_full((tokens.size(0),), tokens.size(1) - 1)  # every row at the prefix's length
        return self.padded_step(unit, tokens[:, -1:], positions, encoder_out, cache)

    def starts_beams_once(self, cache: StaticCache) -> bool:
        """Whether the next step is the first of a cache whose sentences' beams share their encoder-decoder keys
        (fairseq's beam search) and runs one row per sentence: where the static engine's step serves that many rows,
        or, in float32 with more sentences than the row buckets take, through the eager step (oneDNN's products)
        instead of the unit for many rows over every beam (beam 5, batch 64: 64 rows instead of 320, 1.03x a whole
        decode of 25 tokens a sentence at base size; fewer sentences gain nothing: their step is bound by reading
        weights). Under --quantize the units' own rounding stays (int8's eager step: 1.01x, 2 of 128 sentences
        other tokens)."""
        if cache.length != 0 or cache.beams <= 1:
            return False
        sentences = cache.real_rows // cache.beams
        eager_first = self.many_rows_on_cpu and self.precision is None and sentences > self.max_rows
        return self.runs_static_step(sentences) or eager_first

    def first_step_of_beams(self, tokens: Tensor, encoder_out, cache: StaticCache):
        """The first step of sentences of ``cache.beams`` beams: every beam of a sentence holds the same bos, so the
        step runs one row per sentence (a cache of the sentences' keys) and its keys, values and outputs are copied
        to the sentence's beams, as CTranslate2 starts a beam search: 64 rows instead of 320 at beam 5, batch 64."""
        beams, step = cache.beams, self.decoder_step
        sentences = StaticCache(1)
        sentences.start(cache.cross_keys, cache.cross_values, cache.cross_mask, step.heads, step.head_dim)
        lprobs, attn = self.eager_step(tokens[::beams], encoder_out, sentences)  # (sentences, vocab), (sentences, src)
        cache.zeroed = False  # only the first position is written (a new cache holds POSITION_STEP)
        for whole, first in zip(cache.self_keys + cache.self_values, sentences.self_keys + sentences.self_values):
            whole[:, :, :1] = first[:, :, :1].repeat_interleave(beams, dim=0)  # (rows, heads, 1, head_dim)
        cache.length = 1
        return lprobs.repeat_interleave(beams, dim=0), attn.repeat_interleave(beams, dim=0)

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
        """What runs the padded step of ``rows`` rows (``CompiledUnits.step_unit``; None: the eager step, always
        above max_rows with --compiled-many-rows static)."""
        return self.units.step_unit(rows, cache.self_keys[0].size(0), cache.beams, cache.capacity, self.fused)

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
        # the step reads every position of its buffers: they hold the rows' positions and little more, shrunk where
        # a stream's first positions went. Above max_rows its capacity is symbolic (a few positions of room, not
        # shrunk for fewer than 2 * POSITION_STEP spare), else the smallest bucket that holds the positions
        if rows > self.max_rows:
            room, slack = round_up(written + n, POSITION_STEP), 2 * POSITION_STEP
        else:
            room, slack = bucket_capacity(written + n), 1
        if cache.capacity >= room + slack:
            cache.shrink_room(room)
        cache.ensure_room(room, doubling=False)
        cache.zero_unwritten()  # the padded step reads every position, the unattended ones masked
        cache.attended_padding(n)  # the new positions are no row's padding (a released row's dropped ones were)
        rows_index = padded_index(torch.arange(rows, device=tokens.device), self.max_rows)
        inputs = (tokens.index_select(0, rows_index), positions.index_select(0, rows_index),
                  cache.attended(), self.decoder_step.position_table(cache.capacity), cache.self_keys,
                  cache.self_values, cache.cross_keys, cache.cross_values, cache.cross_mask,
                  self.decoder_step.token_table())
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
        rows holding left padding), products through oneDNN on the CPU; with --compiled-many-rows static the
        static engine's step (its exact form, torch's products)."""
        # the eager forms never read unwritten positions: keeping them zero (a memset of most of every buffer
        # at each beam reorder) would be work for nothing; the next compiled step zeroes them again
        cache.zeroed = False
        with self.many_rows_products(tokens.size(0)):
            exact = cache.self_padding is not None or self.static_many_rows
            form = self.decoder_step.exact if exact else self.fast_form
            features, attn = self.next_position(tokens, encoder_out, cache, form)
            lprobs = self.lprobs(features)
        return lprobs, attn[:, -1, : encoder_out["encoder_out"][0].size(0)]

    def fast_form(self, last_tokens: Tensor, position_rows, cache: StaticCache):
        """The decoder step's fast form, its fused query/key/value products through oneDNN where it serves."""
        if self.qkv_packed_from is not self.fused:  # the decode's fused weights: packed once per change
            self.qkv_packed_from = self.fused
            with_onednn = self.eager_linears is not None and not self.precision  # fused_qkv's layers serve
            self.qkv_packed = [pack_weight(w) if with_onednn else None for w in self.fused.qkv_weights]
        fused, packed = self.fused, self.qkv_packed

        def qkv_product(index: int, x: Tensor) -> Tensor:
            weight, bias = fused.qkv_weights[index], fused.qkv_biases[index]
            if self.precision:
                return self.decoder_step.fused_qkv(index, x, weight, bias)
            if packed[index] is not None and onednn_serves(x, weight):
                return onednn_linear(x, packed[index], bias)
            return F.linear(x, weight, bias)

        return self.decoder_step.fast(last_tokens, position_rows, cache, qkv_product)

    def step_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache: StaticCache):
        """Several positions per row (blockwise verification): base features (rows, n, dim) and attention
        (rows, n, src_len) from the padded step of a block of positions, a unit compiled ahead of time on
        the CPU (above ``max_rows`` rows, and with --compiled-freezing each row bucket's); elsewhere the exact
        form, eager with oneDNN's products.  A shorter block (a row near its length limit) runs in the widest
        block's unit, padded at its end: its positions attend none of the padding's, whose keys and values are
        dropped after the call; one position (the bos) runs a unit of its own where head 1's scores come with
        the features (frozen, an identity-first k-head decoder), else the same way."""
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
        if n == 1:  # one position (the bos): its own unit, where one serves, rather than a block's padded
            unit = self.block_unit(rows, 1, cache)
            if unit is not None:
                (features, lprobs), attn = self.run_padded(unit, tokens, positions[:, 0], cache)
                return features, attn[:, :src_len].unsqueeze(1), lprobs
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
        with self.many_rows_products(rows):
            features, attn = super().step_block(tokens.index_select(0, rows_index),
                                                positions.index_select(0, rows_index), encoder_out, cache)
        return features[:rows], attn[:rows, :, :src_len], None

    def proposal_layers(self):
        """Under --quantize int8 blockwise's proposer reads the units' own int8 rows (the vocabulary's, the k-head
        layer's): one copy of them in memory and in the processor's caches."""
        reduced = self.decoder_step.reduced
        return reduced if isinstance(reduced, Int8Weights) else None

    def block_unit(self, rows: int, block: int, cache: StaticCache):
        """The unit compiled ahead of time for ``block`` positions per row of ``rows`` rows, or None (eager)."""
        return self.units.block_unit(rows, cache.self_keys[0].size(0), block, cache.beams, cache.capacity)

    def keep_accepted(self, cache: StaticCache, accepted: Tensor):
        rows_index = padded_index(torch.arange(accepted.size(0), device=accepted.device), self.max_rows)
        cache.keep_accepted(accepted.index_select(0, rows_index))

    def statistics(self) -> dict:
        """For the decoder's statistics: the buckets this runner met and the seconds of their first calls."""
        return self.units.statistics()


def padded_index(index: Tensor, max_rows: int) -> Tensor:
    """``index`` followed by repeats of its first entry up to the row bucket; (row_bucket(n, max_rows),)."""
    bucket = row_bucket(index.numel(), max_rows)
    if bucket == index.numel():
        return index
    return torch.cat([index, index[:1].expand(bucket - index.numel())])
