"""Greedy decoding on the plugin's decoder core; ``greedy-stream`` streams it with refills."""

import torch

from fairseq_fastgen.sequence_generators.generator import FastgenGenerator, one_hypothesis_per_sentence
from fairseq_fastgen.sequence_generators.registry import register_decoder
from fairseq_fastgen.sequence_generators.streaming import (
    PADDING_SENTENCE,
    StreamingScheduler,
    StreamOptions,
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
        best_lprob, best = lprobs.topk(1, dim=-1)  # (rows, 1) each; topk breaks ties as stock beam search
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
            state.select((~finished).nonzero().squeeze(1))


@register_decoder("greedy", guarantee="argmax at every step, token-identical to stock --beam 1")
class GreedyGenerator(FastgenGenerator):
    """Greedy decoding: token-identical to fairseq's beam search with --beam 1."""

    name = "greedy"

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        return cls(model, tgt_dict, gen_cfg, options.common, GreedyPolicy(), projection=projection)


@register_decoder("greedy-stream", prepare_cli=prepare_streaming_cli,
                  guarantee="greedy decoding streamed with refills (continuous batching); greedy's tokens")
class GreedyStreamGenerator(FastgenGenerator):
    """Greedy decoding with streaming refills: the tokens of ``greedy``, and scores that do not depend on
    the sentences decoded beside each one (bitwise those of ``greedy-stream`` on static batches)."""

    name = "greedy-stream"

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        scheduler = StreamingScheduler.from_options(options.of(StreamOptions))
        return cls(model, tgt_dict, gen_cfg, options.common, GreedyPolicy(padded=True), scheduler,
                   projection=projection)
