"""Greedy decoding on the plugin's decoder core; ``greedy-stream`` streams it with refills."""

import torch

from fairseq_fastgen.engine import engine_serves
from fairseq_fastgen.ops.top_token import top_token
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.sequence_generators.generator import FastgenGenerator, one_hypothesis_per_sentence
from fairseq_fastgen.sequence_generators.processors import StepRows
from fairseq_fastgen.registry import register_decoder
from fairseq_fastgen.sequence_generators.streaming import (
    PADDING_SENTENCE,
    StreamingScheduler,
    StreamOptions,
    drain_waiting_rows,
    finished_rows_wait,
    join_any_lengths,
    prepare_streaming_cli,
    select_padded,
)


class GreedyPolicy:
    """Every row takes its most probable next token; a row that emits eos is finished.

    ``padded``: the rows are kept at the padded row counts of ``streaming.py`` (padding rows repeat a real
    row and are ignored), so that a sentence's scores do not depend on the sentences beside it.
    """

    def __init__(self, padded: bool = False):
        self.padded = padded

    def start(self, state, ctx):
        if self.padded:
            select_padded(state, torch.arange(state.rows, device=state.tokens.device))
        return state

    def advance(self, state, ctx):
        lprobs, attn = ctx.next_lprobs(state)  # (rows, vocab), (rows, src_len)
        best_lprob, best = top_token(lprobs)  # (rows, 1) each; ties as topk, as stock beam search
        state.append(best, best_lprob, None if attn is None else attn.unsqueeze(2))
        finished = best.squeeze(1).eq(ctx.eos)  # (rows,)
        real = state.sentence.ne(PADDING_SENTENCE) if self.padded else None  # (rows,) padding rows are ignored
        if real is not None:
            finished &= real
        for row in finished.nonzero().squeeze(1).tolist():
            ctx.finish(int(state.sentence[row]), [ctx.hypothesis(state, row)])
        if real is not None:
            select_padded(state, (real & ~finished).nonzero().squeeze(1))
        elif finished.any():
            state.select(state.runner.surviving_rows(finished))


OWN_FIRST_STEP_ROWS = 8  # JoinedGreedyPolicy: a group of fewer sources takes its first step with the running rows


class JoinedGreedyPolicy:
    """greedy-stream with ``--stream-join-lengths``: a refill's rows join the running ones whatever their
    lengths, and every row takes its step in one model call, each at its own position (the runner's
    ``step_rows``: the step engines right-align the cached positions of joined rows).  A finished row stays as a
    padding row (its steps are computed and ignored) until a refill's row takes its place
    (``join_any_lengths``): no copy of the running rows at a finish or a refill, and the row count stays where
    the kernels are fastest; once no source waits, ``drain`` lets the finished rows go.  The tokens of
    ``greedy``; the scores within float rounding (a row's products run beside rows of other lengths)."""

    joins_lengths = True

    def __init__(self, pad: int):
        self.pad = pad

    join = staticmethod(join_any_lengths)

    def start(self, state, ctx):
        """The sources encoded ahead (``EncodedAhead``) take their first step, at their bos, together in one
        model call (a refill's row would otherwise spend a running call's row on it): each row then takes a
        finished row's place with its first token.  A row whose first token is eos is answered now and waits
        as a padding row, which no refill takes.  A group of fewer than ``OWN_FIRST_STEP_ROWS`` sources (what
        arrived at a live stream: a server's or fairseq-interactive's) only gets its encoder-decoder keys/values:
        its rows join at their bos and take their first step in the running rows' next call, where a call of
        their own would cost about what a whole step of the running rows costs."""
        state.use_row_lengths(int(state.max_len.max()) + 1, self.pad)  # at most max_len tokens and eos
        if state.rows < OWN_FIRST_STEP_ROWS:
            state.runner.start_cache(state.cache, state.encoder_out)
            return state
        self.advance(state, ctx)  # (the step starts the cache: the group's encoder keys/values at once)
        return state

    def advance(self, state, ctx):
        lengths = state.lengths  # (rows,) tokens so far: the last one (the bos at 0) sits at position lengths
        alive = state.sentence.ne(PADDING_SENTENCE)  # (rows,) finished rows wait for a refill's row
        last = state.tokens.gather(1, lengths.unsqueeze(1))  # (rows, 1)
        lprobs, attn = state.runner.step_rows(last, lengths, state.encoder_out, state.cache)  # (rows, vocab)
        ctx.counters.add("model_calls")
        ctx.process(lprobs, StepRows(lengths, state.max_len, state.sentence, state.tokens))  # each at its own step
        best_lprob, best = top_token(lprobs)  # (rows, 1) each
        # every row keeps the position it cached (finished rows' are masked for the row that takes their place)
        state.append_each_row(best, best_lprob, None if attn is None else attn.unsqueeze(2), alive)
        finished = best.squeeze(1).eq(ctx.eos) & alive  # (rows,)
        finished_rows = finished.nonzero().squeeze(1).tolist()
        for row in finished_rows:
            ctx.finish(int(state.sentence[row]), [ctx.hypothesis(state, row)])
        if finished_rows or not bool(alive.all()):
            finished_rows_wait(state, finished)

    @staticmethod
    def drain(state, ctx):
        """No source waits for a place: the finished rows go, but for those that keep the row count a multiple
        of the runner's ``kept_row_multiple`` (where a step costs no more with them)."""
        return drain_waiting_rows(state, state.runner.kept_row_multiple)


@register_decoder("greedy", guarantee="argmax at every step, token-identical to stock --beam 1")
class GreedyGenerator(FastgenGenerator):
    """Greedy decoding: token-identical to fairseq's beam search with --beam 1."""

    name = "greedy"

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        return cls(model, tgt_dict, gen_cfg, options.common, GreedyPolicy(), projection=projection)


@register_decoder("greedy-stream", prepare_cli=prepare_streaming_cli, reads=(StreamOptions,),
                  guarantee="greedy decoding streamed with refills (continuous batching); greedy's tokens")
class GreedyStreamGenerator(FastgenGenerator):
    """Greedy decoding with streaming refills, the tokens of ``greedy``: on a step engine a refill's rows take
    finished rows' places (``JoinedGreedyPolicy``, scores within float rounding); with ``--stream-cohorts`` or
    on fairseq's decoder cohorts of equal length, whose scores do not depend on the sentences decoded beside
    each one (bitwise those of ``greedy-stream`` on static batches)."""

    name = "greedy-stream"

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        stream_options = options.of(StreamOptions)
        joins = joins_lengths(stream_options, engine_serves(model, options.common))
        scheduler = StreamingScheduler.from_options(stream_options, joins_lengths=joins)
        policy = JoinedGreedyPolicy(tgt_dict.pad()) if joins else GreedyPolicy(padded=True)
        return cls(model, tgt_dict, gen_cfg, options.common, policy, scheduler, projection=projection)


def joins_lengths(stream_options: StreamOptions, on_engine: bool) -> bool:
    """Whether greedy-stream joins lengths (``JoinedGreedyPolicy``) or decodes cohorts of equal length: joined
    wherever a step engine runs the model (``on_engine``) unless ``--stream-cohorts``."""
    if stream_options.stream_join_lengths and stream_options.stream_cohorts:
        raise UsageError("--stream-join-lengths and --stream-cohorts are the two forms of greedy-stream: give one")
    if stream_options.stream_join_lengths and not on_engine:
        raise UsageError("--stream-join-lengths runs rows at different lengths in one call, which fairseq's "
                         "incremental decoder cannot: use --step-engine static or compiled (on a model they serve)")
    joins = on_engine and not stream_options.stream_cohorts
    selection = str(stream_options.stream_selection)
    if joins and selection != "min-length":
        raise UsageError(f"--stream-selection {selection} orders greedy-stream's cohorts: add --stream-cohorts (on a "
                         f"step engine its rows join lengths, every row expanding at every iteration)")
    return joins
