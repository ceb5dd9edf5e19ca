"""Streaming: a scheduler that refills a running batch with new sources.

The scheduler of Yang, Yao, DeNero & Klein (2020), apart from any search
policy (variable-width beam, fixed-width beam, greedy, blockwise):

* at most ``capacity`` sources (``--batch-size``), ``capacity_tokens`` source
  tokens (``--max-tokens``) or ``capacity_rows`` candidate rows (the sum of
  the active beams' widths; a source not yet expanded counts at ``--beam``)
  are active at once;
* when the load falls to ``eps`` of that capacity, the next sources of the
  pool (in pool order) are encoded and added as a new *cohort*;
* every cohort is a :class:`DecodingState` whose rows all have the same
  target length, with its own incremental cache; each iteration advances one
  cohort (the least expanded; with ``--stream-selection fifo`` the most, the
  earliest admitted), and cohorts that reach the same length are merged
  (:meth:`DecodingState.concat`).  Sources at different lengths thus never
  share a model call, and encoder outputs and cached keys/values stay with
  their rows.
* a policy whose rows advance by different numbers of tokens (blockwise:
  ``joins_lengths``) keeps one state instead: a refill's rows join the
  running ones whatever their lengths (the runner right-aligns the cached
  positions), so rows at different lengths verify their blocks in one call.
  Its sources are encoded, and started by the policy's ``start`` (blockwise:
  their bos run; greedy: their first step), several capacities at a time
  (``EncodedAhead``).  Right-aligned, every row attends over as many cached
  positions as the longest row holds: a row that runs far longer than the
  others (``--stream-set-aside``) moves out into a side state of its own,
  stepped beside the stream at every iteration until it finishes
  (``SetAside``).

Without a capacity every source of the call starts at once: a static batch
(``var-batch`` uses that).  Any policy with ``start(state, ctx)`` and
``advance(state, ctx)`` streams; the exactness below needs a policy that pads
its rows (``var_beam.py`` does, and ``greedy.py``'s for ``greedy-stream``).

Batch-composition-independent numerics
--------------------------------------
Streaming puts a sentence in model calls with other companions than a static
batch does, so its scores are bit-identical only if no kernel's result for
that sentence depends on its companions.  On the x86 CPU (MKL) used here that
is not free; measured with torch 2.13:

* ``F.linear`` gives a row the same bits as in any other batch when the row
  count is a multiple of 4 (fewer rows, or 5-11 rows with 2 threads, take
  other kernels).  The policies therefore run ``ROW_MULTIPLE``-padded row
  counts: :func:`padded_selection` repeats a real row, whose copy is marked
  ``PADDING_SENTENCE`` and dropped at the next selection.
* The encoder's fused attention (scaled_dot_product_attention) changes the
  last bits of a sentence when the batch pads it to another length.
  :class:`CompanionFreeLayout` encodes sources in groups of equal length (no
  padding) of a multiple of 4 sentences (filled up with repeats).
* The decoder's attention over the encoder depends on where a source's keys
  sit: MKL computes q·Kᵀ in blocks of 4 keys, with other kernels for a last
  partial block and for fewer than 13 keys.  Encoder outputs are therefore
  laid out *right*-padded (source position i is column i for every sentence)
  in a width that is a multiple of ``KEY_BLOCK`` and at least
  ``MIN_KEY_WIDTH``: a sentence's keys then always fall into the same full
  blocks, whatever the width.  A cohort is as wide as its longest source;
  merging right-pads the narrower cohort (``CompanionFreeLayout.widen``),
  where ``DecodingState.concat`` alone would left-pad it.  Hypothesis
  ``attention`` rows follow this layout: row i is source position i, rows
  past the source are padding.

The constants follow one CPU's kernels, not laws: on other CPUs MKL takes
other kernels at small row counts and for wider keys, so there the layout does
not suffice and var-stream gives var-batch's tokens with scores equal to float
rounding.
:func:`kernels_are_companion_free` probes the running CPU for the two
properties; the tests hold the bitwise equality where it holds, and the tokens
and 1e-5 elsewhere.  With it a
sentence's scores do not depend on which sentences share its batch (``tests/sequence_generators/test_streaming.py`` holds var-stream
equal to var-batch sentence by sentence).  It costs a few padding rows per
step and one encoder call per distinct source length.
"""

import functools
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_fastgen.engine import cache_capacity
from fairseq_fastgen.engine.row_plans import LeftJustifySources, NarrowSources, ReleaseRows, WidenSources
from fairseq_fastgen.engine.runner_types import PlacesRows
from fairseq_fastgen.option_checks import UsageError, require_finite_in_range, require_int
from fairseq_fastgen.sequence_generators.state import DecodingState

ROW_MULTIPLE = 4  # row counts that give every row its batch-independent MKL result
KEY_BLOCK = 4  # q·Kᵀ columns computed together
MIN_KEY_WIDTH = 16  # narrower encoder outputs take another q·Kᵀ kernel
PADDING_SENTENCE = -1  # sentence index of padding rows
ENCODED_AHEAD = 4  # a stream that joins lengths encodes this many capacities of sources in one call
COHORT_EPS = 1 / 6  # default refill point of a stream whose refills start cohorts of their own (the paper's)
JOINED_EPS = 1.0  # ... and of one whose refills take finished rows' places: as soon as a source fits
SELECTIONS = ["min-length", "fifo"]  # which cohort a streaming iteration expands
# --stream-set-aside: a row moves out of a joined stream once its output is past the option's length and this many
# times the median of the running rows' ...
SET_ASIDE_MEDIAN_FACTOR = 3
# ... where the stream holds at least this many rows: a smaller stream's step costs about what the side state's would
SET_ASIDE_MIN_ROWS = 8


@dataclass
class StreamOptions(FairseqDataclass):
    stream_eps: Optional[float] = field(
        default=None,
        metadata={"help": "streaming decoders: encode and add new sources when the active ones fall to this "
                          "fraction of the capacity (epsilon of Yang et al. 2020). Default: 1 (a refill as soon as "
                          "a row finishes and a source fits) for blockwise-stream and greedy-stream on a step engine, "
                          "whose refills take finished rows' places; 1/6 for var-stream, fixed-stream and "
                          "greedy-stream --stream-cohorts"},
    )
    stream_capacity: Optional[int] = field(
        default=None,
        metadata={"help": "streaming decoders: at most this many active sources; default: --batch-size "
                          "(fairseq-generate and fairseq-interactive then read larger pools, see --stream-pool); "
                          "from Python, with neither capacity set, each generate() call is one static batch"},
    )
    stream_capacity_tokens: Optional[int] = field(
        default=None,
        metadata={"help": "streaming decoders: at most this many active source tokens; default: --max-tokens"},
    )
    stream_capacity_rows: Optional[int] = field(
        default=None,
        metadata={"help": "streaming decoders: at most this many active candidate rows, the sum of the active "
                          "sources' beam widths (each new source counted at --beam): variable widths packed to "
                          "capacity, a budget in place of a source count"},
    )
    stream_selection: ChoiceEnum(SELECTIONS) = field(
        default="min-length",
        metadata={"help": "streaming decoders: which sources expand at each iteration: min-length, those expanded "
                          "least (Yang et al. 2020); fifo, those admitted first (VAR-STR-FIFO, longest first). "
                          "blockwise-stream, and greedy-stream on a step engine, expand every row at every "
                          "iteration"},
    )
    stream_join_lengths: bool = field(
        default=False,
        metadata={"help": "greedy-stream: a refill's rows join the running ones whatever their lengths, all rows "
                          "in one model call at their own positions; greedy's tokens, scores within float "
                          "rounding. greedy-stream's form wherever a step engine (--step-engine static or "
                          "compiled) runs the model; this flag refuses to run without one",
                  # read by greedy-stream alone (blockwise-stream always joins lengths; the beam streams never do)
                  "decoders": ("greedy-stream",)},
    )
    stream_cohorts: bool = field(
        default=False,
        metadata={"help": "greedy-stream: decode in cohorts of equal length instead, each sentence's scores "
                          "bitwise those of its own static batch whatever streams beside it; slower. The form "
                          "greedy-stream takes on --step-engine fairseq",
                  "decoders": ("greedy-stream",)},
    )
    stream_set_aside: int = field(
        default=32,
        metadata={"help": "greedy-stream and blockwise-stream, whose rows join at any length: a row whose output "
                          "grows past this many tokens and past 3x the median of the running rows leaves the "
                          "stream for a side batch stepped beside it, so that the stream's other rows stop reading "
                          "the cached positions only it holds (a stream's rows attend over as many positions as "
                          "its longest row has); the same tokens; 0: never",
                  "decoders": ("greedy-stream", "blockwise-stream")},
    )
    stream_pool: int = field(
        default=1024,
        metadata={"help": "streaming decoders in fairseq-generate: sentences read per generate() call, streamed "
                          "through the capacity given by --batch-size / --max-tokens with refills (the batch "
                          "options then set the capacity, not the batches); in fairseq-interactive input lines "
                          "enter the stream as they arrive, at most --buffer-size of them read ahead"},
    )


def prepare_streaming_cli(cfg, tool):
    """Registry hook: make fairseq-generate / -interactive hand over pools larger than the capacity.

    The capacity (``--batch-size`` / ``--max-tokens``, or fairseq's defaults)
    is recorded in ``--stream-capacity`` / ``--stream-capacity-tokens`` unless
    given (``--max-tokens`` beside another capacity still sets the tokens');
    fairseq-generate's data iterator then yields whole pools of
    ``--stream-pool`` sentences.  (fairseq-interactive hands its lines to the
    stream one at a time as they arrive: ``fairseq_fastgen/cli/live_lines.py``.)
    The run refuses a sentence longer than the token capacity as fairseq's
    batching refuses one longer than ``--max-tokens``
    (:func:`fairseq_fastgen.cli.oversized_lines.token_limit`).
    """
    generation, dataset = cfg.generation, cfg.dataset
    batch_size, max_tokens = dataset.batch_size, dataset.max_tokens
    if batch_size is None and max_tokens is None:  # fairseq's own defaults of each tool
        if tool == "generate":
            max_tokens = 12000
        else:
            batch_size = 1
    if all(getattr(generation, option, None) is None
           for option in ("stream_capacity", "stream_capacity_tokens", "stream_capacity_rows")):
        generation.stream_capacity = batch_size
        generation.stream_capacity_tokens = max_tokens
    elif getattr(generation, "stream_capacity_tokens", None) is None and dataset.max_tokens is not None:
        generation.stream_capacity_tokens = dataset.max_tokens  # --max-tokens beside another capacity
    dataset.max_tokens = None
    dataset.batch_size = generation.stream_pool if tool == "generate" else max(1, cfg.interactive.buffer_size)


class StreamingScheduler:
    """Refill-on-demand streaming over cohorts of sources (see the module doc)."""

    def __init__(self, capacity: Optional[int] = None, capacity_tokens: Optional[int] = None, eps: float = COHORT_EPS,
                 capacity_rows: Optional[int] = None, selection: str = "min-length", set_aside: int = 0):
        for option, value in (("--stream-capacity", capacity), ("--stream-capacity-tokens", capacity_tokens),
                              ("--stream-capacity-rows", capacity_rows)):
            if value is not None:
                require_int(option, value, 1)
        self.set_aside = require_int("--stream-set-aside", set_aside, 0)
        eps = require_finite_in_range("--stream-eps", eps, 0, 1)
        if selection not in SELECTIONS:
            raise UsageError(f"--stream-selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
        self.capacity = capacity
        self.capacity_tokens = capacity_tokens
        self.capacity_rows = capacity_rows
        self.eps = eps
        self.selection = selection

    @classmethod
    def from_options(cls, options: StreamOptions, joins_lengths: bool = False):
        """The scheduler of ``options``; ``joins_lengths``: the policy's refills take finished rows' places (its
        default ``--stream-eps`` is then ``JOINED_EPS``, else ``COHORT_EPS``)."""
        eps = options.stream_eps
        if eps is None:
            eps = JOINED_EPS if joins_lengths else COHORT_EPS
        return cls(options.stream_capacity, options.stream_capacity_tokens, eps, options.stream_capacity_rows,
                   str(options.stream_selection), options.stream_set_aside if joins_lengths else 0)

    @property
    def streams(self) -> bool:
        return any(c is not None for c in (self.capacity, self.capacity_tokens, self.capacity_rows))

    def run(self, policy, ctx):
        """Decode the pool with ``policy`` to its last sentence."""
        stream = StreamRun(self, policy, ctx)
        while stream.iterate():
            pass


class StreamRun:
    """One pool streaming through a scheduler, an iteration at a time.

    A policy whose rows advance by different numbers of tokens (``joins_lengths``: blockwise) keeps every
    active row in one state, a refill joining it; the others keep cohorts of equal length in the
    companion-free layout.  Whenever the load asks for a refill the pool may ``pull()`` in more sources (a
    live pool: fairseq-interactive's lines as they arrive)."""

    def __init__(self, scheduler: StreamingScheduler, policy, ctx):
        self.scheduler, self.policy, self.ctx = scheduler, policy, ctx
        self.joins_lengths = getattr(policy, "joins_lengths", False)
        self.layout = CompanionFreeLayout()
        self.width = getattr(policy, "width", 1)  # candidate rows of a source not yet expanded
        if self.joins_lengths:  # the sources encoded and started ahead, in groups
            self.encode = EncodedAhead(ctx, ENCODED_AHEAD * (scheduler.capacity or ENCODED_AHEAD), policy.start)
        else:  # each refill encoded, then started
            self.encode = lambda sentences: [policy.start(self.layout.encode(ctx, sentences), ctx)]
        self.merge = policy.join if self.joins_lengths else functools.partial(_merge_equal_lengths,
                                                                              layout=self.layout)
        if scheduler.streams:
            ctx.counters.add("refills", 0)  # reported even when none was needed
        self.next_source = 0  # sources before it (in pool order) have been admitted
        self.cohorts = []
        # joins_lengths: the rows that ran far longer than the stream's others, in a state of their own (SetAside)
        self.aside = SetAside(scheduler.set_aside, ctx) if self.joins_lengths and scheduler.set_aside else None

    @property
    def source_len(self) -> torch.Tensor:
        return self.ctx.pool.source_len  # (pool,) tokens of each source, with eos

    def iterate(self) -> bool:
        """Admit new sources if the load asks for them, then expand one cohort; False once nothing is left
        to decode (a live pool may still grow later)."""
        ctx = self.ctx
        if self._wants_refill():
            ctx.pool.pull()  # a live pool takes in what arrived
            admitted = self._admit() if self.next_source < ctx.pool.size else 0
            if admitted:
                sentences = torch.arange(self.next_source, self.next_source + admitted, device=self.source_len.device)
                self.cohorts = self.merge(self.cohorts + self.encode(sentences))
                if self.next_source:
                    ctx.counters.add("refills")
                self.next_source += admitted
                ctx.pool.admitted(admitted)
        aside = self.aside is not None and self.aside.state is not None
        if not self.cohorts and not aside:  # (sources answered at their start, greedy's at a first eos, leave no row)
            return self.next_source < ctx.pool.size
        drain = getattr(self.policy, "drain", None)
        if drain is not None and self.next_source >= ctx.pool.size:  # no source waits for a finished row's place
            self.cohorts = [c for c in (drain(c, ctx) for c in self.cohorts) if c.rows > 0]
            if not self.cohorts and not aside:
                return False
        if self.cohorts:
            cohort = self._select()
            ctx.counters.record_step("candidate_expansions", int(cohort.sentence.ne(PADDING_SENTENCE).sum()))
            self.policy.advance(cohort, ctx)
        if aside:
            self.aside.advance(self.policy)
        ctx.counters.add("iterations")
        self.cohorts = self.merge([c for c in self.cohorts if c.rows > 0])
        if self.aside is not None and self.cohorts:
            self.aside.take_long_rows(self.cohorts[0])
        return True

    @property
    def states(self) -> List[DecodingState]:
        """Every state whose rows decode: the cohorts, and the side state of rows set aside."""
        aside = [] if self.aside is None or self.aside.state is None else [self.aside.state]
        return self.cohorts + aside

    def forget_empty(self):
        """Drop the states left without rows, and the rows set aside that were cancelled."""
        self.cohorts = [cohort for cohort in self.cohorts if cohort.rows > 0]
        if self.aside is not None and self.aside.state is not None:
            self.aside.drop_waiting()

    def _select(self):
        """The cohort this iteration expands: the least expanded, or with fifo the most (admitted first)."""
        if len(self.cohorts) == 1:
            return self.cohorts[0]
        pick = max if self.scheduler.selection == "fifo" else min
        return pick(self.cohorts, key=lambda c: c.length)

    # ---- capacity ----------------------------------------------------------------
    def _load(self):
        """Active sources, their source tokens and their candidate rows (a source not yet expanded counts
        at the policy's full width, ``--beam`` for the beam searches)."""
        if self.joins_lengths and self.scheduler.capacity_tokens is None and self.scheduler.capacity_rows is None:
            # one row per source, only the source count limited: the rows that are not padding
            active = sum(int(c.sentence.ne(PADDING_SENTENCE).sum()) for c in self.cohorts)
            return active, 0, active
        rows, reals = 0, []
        for cohort in self.cohorts:
            real = cohort.sentence[cohort.sentence.ne(PADDING_SENTENCE)]  # (real rows,) a sentence per beam
            reals.append(real)
            rows += real.numel() if _expanded(cohort) else self.width * real.numel()
        active = torch.cat(reals).unique()  # (active sources,): as many as are active, not the pool's size
        return active.numel(), int(self.source_len.index_select(0, active).sum()), rows

    def _within(self, sentences, tokens, rows, share=1.0):
        """Whether a load is within ``share`` of every capacity."""
        scheduler = self.scheduler
        return all(limit is None or load <= share * limit for load, limit in (
            (sentences, scheduler.capacity), (tokens, scheduler.capacity_tokens), (rows, scheduler.capacity_rows)))

    def _wants_refill(self):
        if not self.cohorts:
            return True
        return self.scheduler.streams and self._within(*self._load(), share=self.scheduler.eps)

    def _admit(self):
        """How many sources, from ``next_source`` on, fit beside the active ones (at least one if none is)."""
        scheduler = self.scheduler
        if not scheduler.streams:
            return self.ctx.pool.size - self.next_source
        # a source counts at least one sentence, token and row: no more than the smallest capacity enter at once
        room = max(1, min(c for c in (scheduler.capacity, scheduler.capacity_tokens, scheduler.capacity_rows)
                          if c is not None))
        pending = self.source_len[self.next_source:self.next_source + room].tolist()
        sentences, tokens, rows = self._load() if self.cohorts else (0, 0, 0)
        admitted = 0
        for length in pending:
            fits = self._within(sentences + admitted + 1, tokens + length, rows + (admitted + 1) * self.width)
            if not fits and (admitted or sentences):
                break
            admitted += 1
            tokens += length
        return admitted


class SetAside:
    """The rows of a joined stream (``joins_lengths``) that ran far longer than its others (``--stream-set-aside``):
    the runner right-aligns the stream's cached positions, so every row's step reads as many positions as its
    longest row holds; a few rows running to the length limit would make every step of the stream read several
    times the keys/values its rows need.  Such a row leaves the stream (its place waits for a refill, as a
    finished row's, and the positions only it attended go) for one side state, stepped by the policy beside the
    stream at every iteration; a row done there leaves it.  The same computation for every row: the tokens the
    stream would give (scores within float rounding, as the stream's)."""

    def __init__(self, after: int, ctx):
        self.after, self.ctx = after, ctx
        self.state: Optional[DecodingState] = None  # the rows set aside, or None

    def take_long_rows(self, stream: DecodingState):
        """Move the rows of ``stream`` whose output is past ``after`` tokens and ``SET_ASIDE_MEDIAN_FACTOR`` times
        the running rows' median into the side state."""
        if stream.rows < SET_ASIDE_MIN_ROWS or stream.row_lengths is None:
            return
        alive, lengths = stream.sentence.ne(PADDING_SENTENCE), stream.row_lengths  # (rows,) each: tokens so far
        if not bool(lengths.masked_fill(~alive, 0).gt(self.after).any()):  # (every iteration: no median to take)
            return
        median = float(lengths[alive].float().median())
        long = alive & lengths.gt(max(self.after, SET_ASIDE_MEDIAN_FACTOR * median))  # (rows,)
        if not bool(long.any()):
            return
        moved = stream.taken(long.nonzero().squeeze(1))
        finished_rows_wait(stream, long)  # their places wait for a refill's rows; only their positions go
        self.ctx.counters.add("rows_set_aside", moved.rows)
        if self.state is None:
            self.state = moved
            return
        width = max(self.state.src_len, moved.src_len)
        self.state = DecodingState.concat([CompanionFreeLayout.widen(self.state, width),
                                           CompanionFreeLayout.widen(moved, width)])

    def advance(self, policy):
        """The side state's step (the policy's), its finished rows gone."""
        state = self.state
        self.ctx.counters.record_step("candidate_expansions", int(state.sentence.ne(PADDING_SENTENCE).sum()))
        self.ctx.counters.add("set_aside_steps")
        policy.advance(state, self.ctx)
        self.drop_waiting()

    def drop_waiting(self):
        """The rows done (answered, or cancelled) leave the side state; no state is left without rows."""
        state = drain_waiting_rows(self.state)
        self.state = state if state.rows else None


def join_any_lengths(parts):
    """The rows of every part in one state (a list of at most one): the first part is the running state (or, where
    none runs, a refill's ``GroupRows``), the others a refill's ``GroupRows``, whatever their lengths: the runner
    right-aligns their cached positions; sources are right-padded to the widest (a group's once, in place, for all
    its refills).  Where the running state keeps finished rows as padding rows (``finished_rows_wait``) and the
    runner can, the refill's rows take their places straight from their group (``DecodingState.place``) and only
    the rows left over are copied out of it and appended (a copy of every row)."""
    if not parts:
        return []
    first, *refills = parts
    running = first.taken() if isinstance(first, GroupRows) else first
    if not refills:
        return [running]
    width = max([running.src_len] + [part.group.src_len for part in refills])
    running = CompanionFreeLayout.widen(running, width)
    free = running.sentence.eq(PADDING_SENTENCE).nonzero().squeeze(1)  # (free rows,)
    if not isinstance(running.runner, PlacesRows):
        free = free[:0]
    places = free_rows_taken(free, [part.index for part in refills])  # the plan: which free rows each part takes
    left_over = []
    for part, (slots, placed, rest) in zip(refills, places):
        group = CompanionFreeLayout.widen(part.group, width)
        if slots.numel():
            running.place(slots, group, placed)  # carried out by the runner (PlaceRows)
        if rest.numel():
            left_over.append(group.taken(rest))
    joined = DecodingState.concat([running] + left_over) if left_over else running
    if isinstance(joined.runner, PlacesRows):
        narrow_sources(joined)
    return [joined]


def free_rows_taken(free: torch.Tensor, parts: List[torch.Tensor]) -> List[tuple]:
    """Which of the ``free`` rows (free,) the rows of each of a refill's parts (n_i,) take, the first part first:
    one (slots, placed, rest) per part, ``slots`` (p_i,) the free rows taken by its rows ``placed`` (p_i,), ``rest``
    (n_i - p_i,) its rows left over (appended after the running rows)."""
    plan = []
    for rows in parts:
        placed = min(free.numel(), rows.numel())
        plan.append((free[:placed], rows[:placed], rows[placed:]))
        free = free[placed:]
    return plan


def narrow_sources(state, slack: int = 2 * KEY_BLOCK):
    """Drop the last source positions of a state whose rows are left-justified (the runner's
    ``left_justified_sources``) when at least ``slack`` of them are padding for every row: a stream's width follows
    its longest running source."""
    mask = state.runner.source_padding(state.encoder_out)  # (rows, src_len)
    used = -(-int((~mask).sum(dim=1).max()) // KEY_BLOCK) * KEY_BLOCK if state.rows else 0
    if state.src_len - used < slack or not bool(mask[:, used:].all()):
        return
    state.encoder_out = state.runner.carry_out(NarrowSources(used), state.encoder_out, state.cache)
    if state.attn is not None:
        state.attn = state.attn[:, :used]  # (rows, used, width)
    state.resize_source_extras(used)
    state.src_len = used


def finished_rows_wait(state, finished, streaming: bool = True) -> torch.Tensor:
    """Rows ``finished`` (rows,) bool have been answered: when ``streaming`` where the runner takes rows in
    place, they stay as padding rows, released from the cache, until a refill's rows take their places
    (``join_any_lengths``) or ``drain_waiting_rows`` lets them go; else they go now.  Returns the rows kept,
    (kept,)."""
    if streaming and isinstance(state.runner, PlacesRows):
        if finished.any():
            state.sentence = state.sentence.masked_fill(finished, PADDING_SENTENCE)
        waiting = state.sentence.eq(PADDING_SENTENCE).nonzero().squeeze(1)  # (waiting,)
        if waiting.numel():  # no longer attended; the positions only finished rows attended dropped
            state.encoder_out = state.runner.carry_out(ReleaseRows(waiting), state.encoder_out, state.cache)
        return torch.arange(state.rows, device=finished.device)
    kept = state.runner.surviving_rows(finished)  # (kept,) in the engine's order
    if kept.numel() < state.rows:
        state.select(kept)
    return kept


def drain_waiting_rows(state, multiple: int = 1):
    """No source waits for a finished row's place any more: the finished rows go, but for as many as keep the
    row count a multiple of ``multiple``."""
    running = state.sentence.ne(PADDING_SENTENCE)  # (rows,)
    kept, waiting = running.nonzero().squeeze(1), (~running).nonzero().squeeze(1)
    kept = torch.cat([kept, waiting[: (-kept.numel()) % multiple if kept.numel() else 0]])
    if kept.numel() < state.rows:
        state.select(kept)
        if kept.numel():  # the positions only the rows that left attended dropped
            state.encoder_out = state.runner.carry_out(ReleaseRows(), state.encoder_out, state.cache)
            narrow_sources(state)
    return state


class GroupRows(NamedTuple):
    """Rows ``index`` (n,) of ``group``, the state of sources encoded and started ahead (``EncodedAhead``), not
    copied out of it yet: a refill's rows take finished rows' places straight from it (``join_any_lengths``)."""

    group: DecodingState
    index: torch.Tensor

    def taken(self) -> DecodingState:
        return self.group.taken(self.index)


class EncodedAhead:
    """Sources encoded and started ahead of their admission, ``group`` sentences in one encoder call and one
    ``start`` of the policy (blockwise: their bos in one model call, greedy: their first step, where each
    refill's would otherwise take a row of a running call; their encoder-decoder keys/values at once): the
    refills of a stream that joins lengths take their rows from the group (``GroupRows``) instead of an encoder
    call and a start each.  fairseq orders a pool by source length, so a group's sources are padded
    little."""

    def __init__(self, ctx, group: int, start):
        self.ctx, self.group, self.start = ctx, group, start  # start(state, ctx) -> state: the policy's
        self.first = 0  # pool position of the group's first sentence
        self.state: Optional[DecodingState] = None  # the group, encoded and started
        self.answered = False  # whether the start answered some of the group's sources (padding rows now)

    def __call__(self, sentences: torch.Tensor) -> List[GroupRows]:
        """The rows of ``sentences`` (consecutive pool positions) in their groups, encoded and started now or
        earlier: one part, or two where they straddle the end of a group (the next group starts there); none for
        sentences the policy's start answered (greedy's whose first token is eos)."""
        first, end = int(sentences[0]), int(sentences[-1]) + 1
        parts = []
        while first < end:
            if self.state is None or not self.first <= first < self.first + self.state.rows:
                self._encode_group(first, min(max(end, first + self.group), self.ctx.pool.size))
            last = min(end, self.first + self.state.rows)
            rows = torch.arange(first - self.first, last - self.first, device=sentences.device)  # (sentences,)
            if self.answered:
                rows = rows[self.state.sentence.index_select(0, rows).ne(PADDING_SENTENCE)]
            if rows.numel():
                parts.append(GroupRows(self.state, rows))
            first = last
        return parts

    def _encode_group(self, first: int, end: int):
        group = self.ctx.start_state(torch.arange(first, end, device=self.ctx.pool.source_len.device))
        if isinstance(group.runner, PlacesRows):  # before its cache holds the rows' encoder-decoder keys
            group.encoder_out = group.runner.carry_out(LeftJustifySources(), group.encoder_out, group.cache)
        self.first, self.state = first, self.start(group, self.ctx)  # (the cache's encoder keys/values at once)
        self.answered = bool(self.state.sentence.eq(PADDING_SENTENCE).any())


def _expanded(cohort) -> bool:
    """Whether a cohort's rows have taken a step (a blockwise state's rows, each at its own length)."""
    return bool(cohort.lengths.gt(0).all())


def _merge_equal_lengths(cohorts, layout):
    """Cohorts at the same target length become one (right-padding the narrower sources)."""
    by_length = {}
    for cohort in cohorts:
        by_length.setdefault(cohort.length, []).append(cohort)
    merged = []
    for group in by_length.values():
        if len(group) > 1:
            width = max(c.src_len for c in group)
            group = [DecodingState.concat([layout.widen(c, width) for c in group])]
        merged.append(group[0])
    return merged


# ---- batch-composition-independent numerics ---------------------------------------------------
class CompanionFreeLayout:
    """Encodes sources so that no sentence's numbers depend on its companions (see the module doc)."""

    @staticmethod
    def width_for(longest: int) -> int:
        return max(MIN_KEY_WIDTH, -(-longest // KEY_BLOCK) * KEY_BLOCK)

    def encode(self, ctx, sentences) -> DecodingState:
        """One row per sentence, encoder outputs right-padded to the width of the longest source."""
        states = []
        lengths = ctx.pool.source_len.index_select(0, sentences)
        width = self.width_for(int(lengths.max()))
        for length in lengths.unique().tolist():
            group = sentences[lengths.eq(length)]
            states.append(self._encode_equal_length(ctx, group, length, width))
        return states[0] if len(states) == 1 else DecodingState.concat(states)

    @staticmethod
    def widen(state: DecodingState, width: int) -> DecodingState:
        """Right-pad a cohort's encoder output, cached encoder keys/values, attention and source-shaped extras to
        ``width``.

        (``DecodingState.concat`` would left-pad them, moving the keys of the narrower cohort.)
        """
        extra = width - state.src_len
        if extra <= 0:
            return state
        plan = WidenSources(state.src_len, extra)
        state.encoder_out = state.runner.carry_out(plan, state.encoder_out, state.cache)  # (width, rows, dim)
        if state.attn is not None:
            state.attn = F.pad(state.attn, (0, 0, 0, extra))  # (rows, width, length)
        state.resize_source_extras(width)
        state.src_len = width
        return state

    def _encode_equal_length(self, ctx, group, length, width):
        batch = group.index_select(0, padded_selection(group.numel(), group.device))
        encoder_out = ctx.runner.encode(ctx.pool.subset(batch))
        ctx.counters.add("encoder_calls")
        right_padded = ctx.runner.right_padded_sources(encoder_out, group.numel(), length, width)  # (width, n, dim)
        bos = torch.full((group.numel(), 1), ctx.eos, dtype=torch.long, device=group.device)
        return DecodingState(
            ctx.runner, bos, group.clone(), ctx.pool.max_len.index_select(0, group),
            right_padded, ctx.runner.new_cache(cache_capacity(ctx.pool.max_len)), width,
        )


@functools.lru_cache(maxsize=None)
def kernels_are_companion_free(threads: int) -> bool:
    """Whether, with ``threads`` torch threads, this CPU gives a row of ``F.linear`` the same bits at every
    padded row count, and a query the same q·Kᵀ bits at every padded key width (random data, fp32)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for features, outputs in ((64, 256), (256, 64), (256, 1024)):
            weight = torch.randn(outputs, features, generator=generator)
            x = torch.randn(64, features, generator=generator)
            every_row = F.linear(x, weight)
            if any(not torch.equal(F.linear(x[:rows], weight), every_row[:rows]) for rows in (4, 8, 12, 16, 32)):
                return False
        queries, keys = torch.randn(8, 1, 16, generator=generator), torch.randn(8, 64, 16, generator=generator)
        widest = torch.bmm(queries, keys.transpose(1, 2))  # (8, 1, 64)
        return all(
            torch.equal(torch.bmm(queries, keys[:, :width].transpose(1, 2)), widest[:, :, :width])
            for width in range(MIN_KEY_WIDTH, 65, KEY_BLOCK)
        )
    finally:
        torch.set_num_threads(previous)


def padded_selection(rows: int, device=None) -> torch.Tensor:
    """Positions 0..rows-1 followed by repeats of position 0 up to a multiple of ROW_MULTIPLE; (padded,)."""
    padding = (-rows) % ROW_MULTIPLE if rows else 0
    return torch.cat([torch.arange(rows, device=device), torch.zeros(padding, dtype=torch.long, device=device)])


def select_padded(state: DecodingState, index: torch.Tensor) -> torch.Tensor:
    """Keep the rows ``index`` of ``state`` plus padding rows; returns the positions used, (padded rows,).

    Position p of the result is row ``index[positions[p]]``; rows past ``index.numel()``
    are padding (sentence ``PADDING_SENTENCE``), which policies ignore.
    """
    positions = padded_selection(index.numel(), index.device)
    state.select(index.index_select(0, positions))
    state.sentence[index.numel():] = PADDING_SENTENCE
    return positions


def real_rows(state: DecodingState) -> torch.Tensor:
    """Rows of ``state`` that are not padding; (real rows,)."""
    return state.sentence.ne(PADDING_SENTENCE).nonzero().squeeze(1)

