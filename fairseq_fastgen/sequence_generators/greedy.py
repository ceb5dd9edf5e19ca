"""Greedy decoding on the plugin's decoder core."""

import torch

from fairseq_fastgen.sequence_generators.generator import FastgenGenerator
from fairseq_fastgen.sequence_generators.registry import register_decoder


class GreedyPolicy:
    """Every row takes its most probable next token; a row that emits eos is finished."""

    def start(self, state, ctx):
        return state

    def advance(self, state, ctx):
        lprobs, attn = ctx.next_lprobs(state)  # (rows, vocab), (rows, src_len)
        best_lprob, best = lprobs.topk(1, dim=-1)  # (rows, 1) each; topk breaks ties as stock beam search
        state.append(best, best_lprob, None if attn is None else attn.unsqueeze(2))
        finished = best.squeeze(1).eq(ctx.eos)
        for row in finished.nonzero().squeeze(1).tolist():
            ctx.finish(int(state.sentence[row]), [ctx.hypothesis(state, row)])
        if finished.any():
            state.select((~finished).nonzero().squeeze(1))


@register_decoder("greedy", guarantee="argmax at every step, token-identical to stock --beam 1")
class GreedyGenerator(FastgenGenerator):
    """Greedy decoding: token-identical to fairseq's beam search with --beam 1."""

    name = "greedy"

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, projection=None):
        return cls(model, tgt_dict, gen_cfg, GreedyPolicy(), projection=projection)
