"""Variable-width and fixed-width beam search; decoders ``var-batch``, ``var-stream``, ``fixed-stream``.

The search of Yang, Yao, DeNero & Klein (2020), "A Streaming Approach for
Efficient Batched Beam Search", with the pruning of Freitag & Al-Onaizan
(2017).  Per sentence, the beam holds at most ``beam`` candidates (less the
hypotheses already collected), each open or finished (ending in eos).  One
step:

1. every open row proposes its ``max_cands`` most probable continuations
   (score: cumulative log-probability, not length-normalised);
2. finished candidates still on the beam compete again with their score;
3. the best ``beam - collected`` candidates survive;
4. while the best survivor is finished it is collected (up to ``nbest``):
   a finished candidate that is not the best of its beam stays on the beam
   until it becomes the best or is pushed out (the paper's appendix A.1);
5. candidates more than ``delta`` below the best (the best collected
   hypothesis included) are dropped.

A sentence ends when it has ``nbest`` hypotheses or no candidate is left; its
hypotheses are then ranked with length normalisation (``--lenpen``), as
fairseq does.  Scores never increase along a hypothesis, so a collected
hypothesis is never beaten by a later one of the same beam in raw score.
Stock fairseq beam search instead collects ``beam`` finished hypotheses and
ranks them length-normalised, which favours longer outputs; ``--nbest`` equal
to ``--beam`` brings fixed-width search close to it (on the toy model 190 of
200 sentences token-identical at beam 5, against 125 with ``--nbest 1``).

Fixed-width beam search is the same search with ``delta = inf`` and
``max_cands = beam``.  Rows are ordered sentence by sentence, best first, and
padded to the row counts of ``streaming.py`` so that a sentence's result does
not depend on the sentences it is batched with: ``var-stream`` is
token- and score-identical to ``var-batch``, and ``fixed-stream`` to
fixed-width search on static batches.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from fairseq.dataclass import FairseqDataclass

from fairseq_fastgen.option_checks import require_finite_in_range, require_int
from fairseq_fastgen.sequence_generators.generator import FastgenGenerator
from fairseq_fastgen.registry import register_decoder
from fairseq_fastgen.sequence_generators.streaming import (
    StreamingScheduler,
    StreamOptions,
    prepare_streaming_cli,
    real_rows,
    select_padded,
)

NEG_INF = -math.inf


@dataclass
class VarBeamOptions(FairseqDataclass):
    var_beam_delta: float = field(
        default=1.5,
        metadata={"help": "variable-width beam: drop candidates whose log-probability is more than this below the "
                          "best candidate of their beam (finished ones included); inf: no threshold"},
    )
    var_beam_max_cands: int = field(
        default=5,
        metadata={"help": "variable-width beam: at most this many continuations of each candidate "
                          "(the beam width is --beam)"},
    )


class SentenceRecords:
    """Per-sentence search records of one ``generate`` call, indexed by pool position."""

    def __init__(self, pool_size, beam, device):
        self.waiting_scores = torch.full((pool_size, beam), NEG_INF, device=device)  # finished, still on the beam
        self.waiting: List[Dict[int, dict]] = [{} for _ in range(pool_size)]  # beam slot -> hypothesis
        self.collected: List[List[dict]] = [[] for _ in range(pool_size)]
        self.collected_count = torch.zeros(pool_size, dtype=torch.long, device=device)
        self.best_collected = torch.full((pool_size,), NEG_INF, device=device)

    def grow(self, pool_size):
        """Records for the sentences a live pool took in since (fairseq-interactive's lines)."""
        extra = pool_size - len(self.waiting)
        if extra <= 0:
            return
        self.waiting_scores = F.pad(self.waiting_scores, (0, 0, 0, extra), value=NEG_INF)
        self.waiting += [{} for _ in range(extra)]
        self.collected += [[] for _ in range(extra)]
        self.collected_count = F.pad(self.collected_count, (0, extra))
        self.best_collected = F.pad(self.best_collected, (0, extra), value=NEG_INF)


@dataclass
class StepBeams:
    """The ranked candidates of one step; (groups, beam) tensors, one group per sentence."""

    sentences: torch.Tensor  # (groups,) pool index of each group's sentence
    first_row: torch.Tensor  # (groups,) the group's best row in the state
    best: torch.Tensor  # cumulative log-probability of each candidate, best first
    waiting_slot: torch.Tensor  # beam slot of a finished candidate that was waiting on the beam
    from_waiting: torch.Tensor  # the candidate was waiting on the beam (finished earlier)
    parent_row: torch.Tensor  # the state row a new candidate extends
    token: torch.Tensor  # the token a new candidate appends
    # set by the rules
    finished: Optional[torch.Tensor] = None  # valid and ends in eos
    collected: Optional[torch.Tensor] = None  # finished and collected at this step
    keep: Optional[torch.Tensor] = None  # stays on the beam
    done: Optional[torch.Tensor] = None  # (groups,) the sentence's search is over


class BeamSearchPolicy:
    """Beam search with per-sentence beams of variable width (see the module docstring)."""

    def __init__(self, beam: int, nbest: int = 1, delta: float = math.inf, max_cands: Optional[int] = None):
        if beam < 1 or nbest < 1:
            raise ValueError("--beam and --nbest must be at least 1")
        delta = require_finite_in_range("--var-beam-delta", delta, 0, allow_inf=True)  # NaN would drop every candidate
        if max_cands is not None:
            require_int("--var-beam-max-cands", max_cands, 1)
        self.beam = beam
        self.nbest = min(nbest, beam)
        self.delta = delta
        self.max_cands = beam if max_cands is None else max_cands
        self._records, self._records_ctx = None, None

    @property
    def width(self) -> int:
        """Candidate rows a source may hold (streaming's --stream-capacity-rows counts new sources at it)."""
        return self.beam

    def forget(self, sentences, ctx):
        """Drop the search records of ``sentences`` (pool positions) that left unanswered (a live stream's
        cancelled sentences): their hypotheses collected or waiting on the beam."""
        records = self.records(ctx)
        for sentence in sentences:
            records.collected[sentence], records.waiting[sentence] = [], {}
            records.waiting_scores[sentence] = NEG_INF

    def records(self, ctx) -> SentenceRecords:
        if self._records_ctx is not ctx:  # a new generate() call
            self._records = SentenceRecords(ctx.pool.size, self.beam, ctx.pool.src_lengths.device)
            self._records_ctx = ctx
        self._records.grow(ctx.pool.size)
        return self._records

    def start(self, state, ctx):
        self.records(ctx)
        select_padded(state, torch.arange(state.rows, device=state.tokens.device))
        return state

    def advance(self, state, ctx):
        records = self.records(ctx)
        lprobs, attn = ctx.next_lprobs(state)  # (rows, vocab), (rows, src_len) or None
        beams = self._beams(state, lprobs, records, ctx.eos)
        self._collect_and_wait(beams, state, attn, ctx, records)
        for group in beams.done.nonzero().squeeze(1).tolist():
            sentence = int(beams.sentences[group])
            if not records.collected[sentence]:  # every continuation was banned: end the best row
                first = beams.first_row[group : group + 1]
                hypotheses = self._hypotheses(state, ctx, first, state.scores[first] + lprobs[first, ctx.eos], attn)
                records.collected[sentence] = hypotheses
            ctx.finish(sentence, records.collected[sentence])
            records.collected[sentence], records.waiting[sentence] = [], {}
        keep_open = beams.keep & ~beams.finished & ~beams.done.unsqueeze(1)  # (sentences, beam)
        parents, tokens = beams.parent_row[keep_open], beams.token[keep_open]  # (open,) each
        positions = select_padded(state, parents)
        parents, tokens = parents[positions], tokens[positions]
        new_attn = None if attn is None else attn[parents].unsqueeze(2)
        state.append(tokens.unsqueeze(1), lprobs[parents, tokens].unsqueeze(1), new_attn)

    # ---- one step, vectorised over the sentences of the state ------------------------------
    def _beams(self, state, lprobs, records, eos):
        """Rank every sentence's candidates, then apply the width, collection and threshold rules."""
        beams = self._rank(state, lprobs, records)
        self._apply_rules(beams, records, eos)
        return beams

    def _rank(self, state, lprobs, records):
        """The ``beam`` best candidates of every sentence: continuations of its rows and waiting ones."""
        beam, cands = self.beam, min(self.max_cands, lprobs.size(1))
        rows = real_rows(state)  # (n,) rows of a sentence are adjacent, best first
        sentences, counts = torch.unique_consecutive(state.sentence[rows], return_counts=True)  # (groups,)
        group = torch.repeat_interleave(torch.arange(sentences.numel(), device=rows.device), counts)  # (n,)
        first = torch.cumsum(counts, 0) - counts  # (groups,) position of each group's best row in ``rows``
        rank = torch.arange(rows.numel(), device=rows.device) - first[group]  # (n,)

        scores = state.scores.unsqueeze(1) + lprobs  # (rows, vocab)
        top_scores, top_tokens = scores.topk(cands, dim=1)  # (rows, cands)
        expansions = beam * cands
        pool = scores.new_full((sentences.numel(), expansions + beam), NEG_INF)  # (groups, beam*cands + beam)
        columns = rank.unsqueeze(1) * cands + torch.arange(cands, device=rows.device)  # (n, cands)
        pool[group.unsqueeze(1), columns] = top_scores[rows]
        pool[:, expansions:] = records.waiting_scores[sentences]
        best, slot = pool.topk(beam, dim=1)  # (groups, beam) best first

        expansion = slot.clamp(max=expansions - 1)
        parent = first.unsqueeze(1) + torch.div(expansion, cands, rounding_mode="floor")
        parent_row = rows[parent.clamp(max=rows.numel() - 1)]  # (groups, beam); meaningless where invalid
        return StepBeams(
            sentences=sentences, first_row=rows[first], best=best, waiting_slot=slot - expansions,
            from_waiting=slot >= expansions, parent_row=parent_row, token=top_tokens[parent_row, expansion % cands],
        )

    def _apply_rules(self, beams, records, eos):
        """Mark valid, finished, collected and kept candidates and finished searches; count collections."""
        sentences, best = beams.sentences, beams.best
        width = self.beam - records.collected_count[sentences]  # (groups,)
        valid = best.gt(NEG_INF) & (torch.arange(self.beam, device=best.device) < width.unsqueeze(1))
        beams.finished = valid & (beams.from_waiting | beams.token.eq(eos))
        leading = torch.cumprod(beams.finished.long(), dim=1)  # 1 on the run of finished candidates at the top
        quota = self.nbest - records.collected_count[sentences]
        beams.collected = leading.bool() & (leading.cumsum(1) <= quota.unsqueeze(1))
        remaining = valid & ~beams.collected
        best_collected = torch.maximum(
            records.best_collected[sentences], best.masked_fill(~beams.collected, NEG_INF).max(dim=1).values
        )
        records.best_collected[sentences] = best_collected
        records.collected_count[sentences] += beams.collected.sum(1)
        reference = torch.maximum(best_collected, best.masked_fill(~remaining, NEG_INF).max(dim=1).values)
        beams.keep = remaining & best.ge(reference.unsqueeze(1) - self.delta)
        beams.done = records.collected_count[sentences].ge(self.nbest) | ~beams.keep.any(dim=1)

    def _collect_and_wait(self, beams, state, attn, ctx, records):
        """Move collected hypotheses to the records and keep the finished candidates that stay on the beam."""
        waits = beams.keep & beams.finished & ~beams.done.unsqueeze(1)
        events = beams.collected | waits  # (groups, beam)
        fresh = events & ~beams.from_waiting
        parents = beams.parent_row[fresh]
        fresh_hypotheses = iter(self._hypotheses(state, ctx, parents, beams.best[fresh], attn))
        new_waiting: Dict[int, Dict[int, dict]] = {}
        sentences = beams.sentences.tolist()
        for group, position in events.nonzero().tolist():
            sentence = sentences[group]
            if beams.from_waiting[group, position]:
                hypothesis = records.waiting[sentence][int(beams.waiting_slot[group, position])]
            else:
                hypothesis = next(fresh_hypotheses)
            if beams.collected[group, position]:
                records.collected[sentence].append(hypothesis)
            else:
                new_waiting.setdefault(sentence, {})[position] = hypothesis
        records.waiting_scores[beams.sentences] = beams.best.masked_fill(~waits, NEG_INF)
        for sentence in sentences:
            records.waiting[sentence] = new_waiting.get(sentence, {})

    def _hypotheses(self, state, ctx, parents, scores, attn):
        """Hypotheses of the rows ``parents`` (of ``state``) continued by eos with cumulative ``scores``."""
        eos = torch.full((parents.numel(),), ctx.eos, dtype=torch.long, device=parents.device)
        rows = state.candidate_rows(parents, eos, scores, None if attn is None else attn[parents])
        return [ctx.hypothesis(rows, i) for i in range(parents.numel())]


class BeamGenerator(FastgenGenerator):
    """A beam policy on a (streaming or static) scheduler; subclasses choose both."""

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        generator = cls(model, tgt_dict, gen_cfg, options.common, cls.policy_for(gen_cfg, options),
                        cls.scheduler_for(options), projection)
        generator.nbest = gen_cfg.nbest
        return generator

    @staticmethod
    def policy_for(gen_cfg, options):
        return BeamSearchPolicy(gen_cfg.beam, gen_cfg.nbest)

    @staticmethod
    def scheduler_for(options):
        return StreamingScheduler.from_options(options.of(StreamOptions))


def variable_beam_policy(gen_cfg, options):
    var_beam = options.of(VarBeamOptions)
    return BeamSearchPolicy(gen_cfg.beam, gen_cfg.nbest, var_beam.var_beam_delta, var_beam.var_beam_max_cands)


@register_decoder("var-batch", options=VarBeamOptions,
                  guarantee="variable-width beam search (Yang et al. 2020) on static batches")
class VarBatchGenerator(BeamGenerator):
    """Variable-width beam search, every sentence of a batch decoded together."""

    name = "var-batch"
    policy_for = staticmethod(variable_beam_policy)

    @staticmethod
    def scheduler_for(options):
        return StreamingScheduler()


@register_decoder("var-stream", options=StreamOptions, prepare_cli=prepare_streaming_cli, reads=(VarBeamOptions,),
                  guarantee="variable-width beam search, streamed with refills; identical to var-batch")
class VarStreamGenerator(BeamGenerator):
    """Variable-width beam search with streaming refills; token- and score-identical to var-batch."""

    name = "var-stream"
    policy_for = staticmethod(variable_beam_policy)


@register_decoder("fixed-stream", prepare_cli=prepare_streaming_cli, reads=(StreamOptions,),
                  guarantee="fixed-width beam search, streamed with refills")
class FixedStreamGenerator(BeamGenerator):
    """Fixed-width beam search with streaming refills; token- and score-identical to it on static batches."""

    name = "fixed-stream"
