"""Stock beam search with a leaner loop around the model: same search, fewer passes over the vocabulary.

Outside the model, every step of fairseq's ``SequenceGenerator._generate`` makes
several passes over the whole (rows, vocab) log-probability matrix:

* a NaN guard that compares every entry and rewrites the matrix
  (``lprobs[lprobs != lprobs] = -inf``);
* ``BeamSearch.step``, which adds each beam's score to all of its entries,
  writing a second matrix, and runs one top-k over beam * vocab per sentence
  (torch's CPU top-k is a scalar loop).

:class:`LeanBeamLoop` runs the same search with:

* the NaN guard on row sums: log-probabilities are finite or -inf, so a row
  sums to NaN exactly when it holds a NaN; only then is the matrix rewritten;
* :func:`top_candidates`: the maximum of each chunk of 64 entries, plus the
  beam's score, ranks the chunks; the top 2M chunks of a sentence hold its top
  2M candidates, and only their entries get the beam's score added (the same
  float additions as fairseq's) and go through a small top-k.

Everything else follows fairseq's rules, through its own methods where it has
them (``finalize_hypos``, the ensemble's encoder/decoder calls and reorders):
the first step expands beam 0 only, 2M candidates per sentence, eos among the
top M finalizes a hypothesis, a sentence ends with M of them, the M best
non-eos candidates continue.  Tokens, scores, positional scores and attention
are bitwise stock fairseq's (``tests/fastseq/test_beam_loop.py``); two
candidates with bitwise-equal scores are ordered arbitrarily by top-k in both
loops.  What the lean loop does not implement (lexical constraints, prefix
tokens, a language model, search strategies other than beam search,
``--match-source-len``) runs through fairseq's own loop, unchanged.
"""

import logging
import math
from typing import Dict, List, Optional, Set

import torch
from torch import Tensor
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator

from fairseq_fastgen.fastseq.shared_cache import IncrementalState

CHUNK = 64  # entries per chunk of a row in top_candidates
logger = logging.getLogger("fairseq_fastgen.fastseq")
_stock_rule_named = []  # the line saying fairseq's loop keeps stock's stopping rule: once per process


def top_candidates(lprobs: Tensor, prev_scores: Optional[Tensor], k: int):
    """Top ``k`` of ``lprobs + prev_scores`` per sentence, over all its beams and tokens.

    lprobs: (bsz, beams, vocab); prev_scores: (bsz, beams) cumulative score of each
    beam, or None (nothing added).  Returns values (bsz, k), beams (bsz, k) and
    tokens (bsz, k), best first: what ``torch.topk`` over the flattened sum gives.
    """
    bsz, beams, vocab = lprobs.shape
    chunks = vocab // CHUNK
    if chunks < k:  # a small vocabulary: the plain computation is as cheap
        totals = lprobs if prev_scores is None else lprobs + prev_scores.unsqueeze(2)
        values, flat = totals.reshape(bsz, beams * vocab).topk(k, dim=1)
        return values, flat // vocab, flat % vocab
    head = chunks * CHUNK
    keys = lprobs[:, :, :head].reshape(bsz, beams, chunks, CHUNK).amax(dim=3)  # (bsz, beams, chunks)
    if prev_scores is not None:
        keys = keys + prev_scores.unsqueeze(2)  # = max over the chunk of lprobs + score (rounding is monotonic)
    best_chunks = keys.view(bsz, beams * chunks).topk(k, dim=1).indices  # (bsz, k)
    offsets = torch.arange(CHUNK, device=lprobs.device)
    starts = (best_chunks // chunks) * vocab + (best_chunks % chunks) * CHUNK  # flat (beam, token) index
    index = (starts.unsqueeze(2) + offsets).view(bsz, k * CHUNK)
    if head < vocab:  # the last, partial chunk of every beam is always a candidate
        tail = (torch.arange(beams, device=lprobs.device) * vocab).unsqueeze(1) + torch.arange(
            head, vocab, device=lprobs.device
        )
        index = torch.cat([index, tail.view(1, -1).expand(bsz, -1)], dim=1)
    values = lprobs.reshape(bsz, beams * vocab).gather(1, index)  # (bsz, candidates)
    if prev_scores is not None:
        values = values + prev_scores.gather(1, index // vocab)
    top, position = values.topk(k, dim=1)
    flat = index.gather(1, position)
    return top, flat // vocab, flat % vocab


def rows_of(cand_beams: Tensor, beam: int) -> Tensor:
    """(bsz, cands) beam of each candidate within its sentence -> its row in the (bsz * beam) batch."""
    return cand_beams + (torch.arange(cand_beams.size(0), device=cand_beams.device) * beam).unsqueeze(1)


def mask_nan_(lprobs: Tensor) -> Tensor:
    """Set NaN entries to -inf, as fairseq does, after a check that reads the matrix once."""
    if torch.isnan(lprobs.sum(dim=-1)).any():
        lprobs.masked_fill_(torch.isnan(lprobs), -math.inf)
    return lprobs


class LeanBeamLoop(SequenceGenerator):
    """fairseq's SequenceGenerator whose beam search loop is :mod:`this module's <beam_loop>`.

    ``top_eos_stops`` (``--stop-at-top-eos``): a sentence also ends once its best candidate at a step has been
    eos and ``nbest_wanted`` of its hypotheses have ended (CTranslate2's early exit); its hypotheses are then the
    first ones stock's search ends (the steps up to there are stock's).  Without length normalization
    (``--unnormalized``) no later hypothesis can score higher, and the best one is stock's."""

    top_eos_stops = False
    nbest_wanted = 1

    def lean_loop_applies(self, sample, prefix_tokens, constraints) -> bool:
        net_input = sample["net_input"]
        return (
            type(self.search) is search.BeamSearch
            and self.lm_model is None
            and constraints is None
            and prefix_tokens is None
            and not self.match_source_len
            and not self.should_set_src_lengths
            and "src_tokens" in net_input
            and net_input["src_tokens"].dim() == 2
        )

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        if not self.lean_loop_applies(sample, prefix_tokens, constraints):
            if self.top_eos_stops and not _stock_rule_named:
                _stock_rule_named.append(True)
                logger.warning("--stop-at-top-eos: this search (prefix tokens, constraints, another search "
                               "strategy or a language model) runs fairseq's own loop, with stock's stopping rule")
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]  # (bsz, src_len)
        src_lengths = net_input.get("src_lengths")
        if src_lengths is None:
            src_lengths = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)
        bsz, src_len = src_tokens.size()
        beam, device = self.beam_size, src_tokens.device
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"

        states: List[IncrementalState] = [{} for _ in range(self.model.models_size)]
        with torch.autograd.profiler.record_function("EnsembleModel: forward_encoder"):
            encoder_outs = self.model.forward_encoder(net_input)
        encoder_outs = self.model.reorder_encoder_out(
            encoder_outs, torch.arange(bsz, device=device).repeat_interleave(beam)
        )
        tokens = src_tokens.new_full((bsz * beam, max_len + 2), self.pad)  # (rows, max_len + 2)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        scores = torch.zeros(bsz * beam, max_len + 1, device=device)  # (rows, max_len + 1) cumulative
        attn: Optional[Tensor] = None  # (rows, src_len, max_len + 2)
        ignored = torch.zeros(bsz, beam, dtype=torch.bool, device=device)  # beams with nothing left to finalize
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        finished = [False] * bsz
        top_ended: Set[int] = set()  # sentences whose best candidate has ended (--stop-at-top-eos)
        remaining = bsz
        cand_size = 2 * beam
        cand_offsets = torch.arange(cand_size, device=device)
        reorder: Optional[Tensor] = None  # (rows,) the row each new row continues
        kept: Optional[Tensor] = None  # (bsz,) sentences kept at the last step, when some finished

        for step in range(max_len + 1):
            if reorder is not None:
                if kept is not None:  # rows were numbered before finished sentences left
                    shift = kept - torch.arange(kept.numel(), device=device)
                    reorder.view(-1, beam).add_(shift.unsqueeze(1) * beam)
                self.model.reorder_incremental_state(states, reorder)
                encoder_outs = self.model.reorder_encoder_out(encoder_outs, reorder)
            with torch.autograd.profiler.record_function("EnsembleModel: forward_decoder"):
                lprobs, avg_attn = self.model.forward_decoder(
                    tokens[:, : step + 1], encoder_outs, states, self.temperature
                )  # (rows, vocab), (rows, src_len) or None
            self._constrain(mask_nan_(lprobs), step, max_len)
            if avg_attn is not None:
                if attn is None:
                    attn = torch.empty(bsz * beam, avg_attn.size(1), max_len + 2).to(scores)
                attn[:, :, step + 1].copy_(avg_attn)
            if self.repeat_ngram_blocker is not None:
                lprobs = self.repeat_ngram_blocker(tokens, lprobs, bsz, beam, step)

            cand_scores, cand_beams, cand_tokens = self._step_candidates(step, lprobs, scores, bsz, cand_size)
            cand_rows = rows_of(cand_beams, beam)  # (bsz, cand_size)
            eos_mask = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)
            eos_mask[:, :beam][ignored] = False
            eos_rows = torch.masked_select(cand_rows[:, :beam], eos_mask[:, :beam])
            newly_finished: List[int] = []
            if eos_rows.numel() > 0:
                eos_scores = torch.masked_select(cand_scores[:, :beam], eos_mask[:, :beam])
                # each batch row's sentence, before finalize_hypos marks some finished (--stop-at-top-eos only)
                open_sentences = [s for s, done in enumerate(finished) if not done] if self.top_eos_stops else []
                newly_finished = self.finalize_hypos(
                    step, eos_rows, eos_scores, tokens, scores, finalized, finished, beam, attn,
                    src_lengths, max_len,
                )
                if self.top_eos_stops:
                    newly_finished += self.ended_at_top(eos_mask[:, 0], eos_mask[:, :beam].any(dim=1),
                                                        open_sentences, top_ended, finalized, finished)
                remaining -= len(newly_finished)
            if remaining == 0:
                break
            assert step < max_len, f"{step} < {max_len}"

            kept = None
            if newly_finished:
                keep = torch.ones(bsz, dtype=torch.bool, device=device)
                keep[newly_finished] = False
                kept = torch.arange(bsz, device=device).masked_select(keep)
                eos_mask, cand_beams = eos_mask[kept], cand_beams[kept]
                cand_scores, cand_tokens = cand_scores[kept], cand_tokens[kept]
                src_lengths, ignored = src_lengths[kept], ignored[kept]
                new_bsz = kept.numel()
                cand_rows = rows_of(cand_beams, beam)
                scores = scores.view(bsz, -1)[kept].view(new_bsz * beam, -1)
                tokens = tokens.view(bsz, -1)[kept].view(new_bsz * beam, -1)
                if attn is not None:
                    attn = attn.view(bsz, -1)[kept].view(new_bsz * beam, attn.size(1), -1)
                bsz = new_bsz

            # the beam best non-eos candidates continue: eos (or ignored) ones rank after all others
            eos_mask[:, :beam] = ignored | eos_mask[:, :beam]
            rank = eos_mask.long() * cand_size + cand_offsets[: eos_mask.size(1)]
            rank_kept, active = torch.topk(rank, k=beam, dim=1, largest=False)  # (bsz, beam)
            ignored = rank_kept.ge(cand_size)[:, :beam]
            assert (~ignored).any(dim=1).all()
            reorder = cand_rows.gather(1, active).view(-1)  # (rows,)
            tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, reorder)
            tokens.view(bsz, beam, -1)[:, :, step + 1] = cand_tokens.gather(1, active)
            if step > 0:
                scores[:, :step] = scores[:, :step].index_select(0, reorder)
            scores.view(bsz, beam, -1)[:, :, step] = cand_scores.gather(1, active)
            if attn is not None:
                attn[:, :, : step + 2] = attn[:, :, : step + 2].index_select(0, reorder)

        for sentence, hypotheses in enumerate(finalized):  # best first, ordered as fairseq orders them
            order = torch.sort(torch.tensor([float(h["score"].item()) for h in hypotheses]), descending=True)[1]
            finalized[sentence] = [hypotheses[i] for i in order]
        return finalized

    def ended_at_top(self, best_ended: Tensor, some_ended: Tensor, open_sentences: List[int], top_ended: Set[int],
                     finalized, finished: List[bool]) -> List[int]:
        """The batch rows whose sentence's best candidate has ended (now: ``best_ended`` (bsz,) bool, or at an
        earlier step: ``top_ended``, updated here) and that have ``nbest_wanted`` hypotheses ended (some now:
        ``some_ended`` (bsz,) bool), not finished by stock's rule: marked finished in ``finished``."""
        rows, best = [], best_ended.tolist()
        for row in torch.nonzero(some_ended).view(-1).tolist():
            sentence = open_sentences[row]
            if best[row]:
                top_ended.add(sentence)
            if sentence in top_ended and not finished[sentence] and len(finalized[sentence]) >= self.nbest_wanted:
                finished[sentence] = True
                rows.append(row)
        return rows

    def _constrain(self, lprobs: Tensor, step: int, max_len: int):
        """fairseq's edits of the step's log-probabilities, in its order (no prefix tokens here)."""
        lprobs[:, self.pad] = -math.inf
        lprobs[:, self.unk] -= self.unk_penalty
        if step >= max_len:  # only eos may follow
            lprobs[:, : self.eos] = -math.inf
            lprobs[:, self.eos + 1 :] = -math.inf
        if step < self.min_len:
            lprobs[:, self.eos] = -math.inf
        if self.token_indices_to_suppress is not None:
            lprobs[:, self.token_indices_to_suppress] = -math.inf

    def _step_candidates(self, step: int, lprobs: Tensor, scores: Tensor, bsz: int, cand_size: int):
        """``BeamSearch.step``'s candidates: scores, beams and tokens, each (bsz, cand_size)."""
        by_beam = lprobs.view(bsz, self.beam_size, -1)  # (bsz, beam, vocab)
        if step == 0:  # every beam holds the same prefix: expand beam 0 only
            first = by_beam[:, :1, :]
            return top_candidates(first, None, min(cand_size, first.size(2) - 1))
        previous = scores.view(bsz, self.beam_size, -1)[:, :, step - 1]  # (bsz, beam)
        return top_candidates(by_beam, previous, min(cand_size, by_beam[0].numel() - 1))


def use_lean_beam_loop(generator, top_eos_stops: bool = False, nbest: int = 1) -> bool:
    """Switch a stock SequenceGenerator (exactly that class) to :class:`LeanBeamLoop`; returns whether it did.
    ``top_eos_stops``, ``nbest``: ``--stop-at-top-eos`` and ``--nbest`` (:class:`LeanBeamLoop`).

    Subclasses (e.g. ``SequenceGeneratorWithAlignment``) keep their own loop.
    """
    if type(generator) is not SequenceGenerator:
        return isinstance(generator, LeanBeamLoop)
    generator.__class__ = LeanBeamLoop
    if top_eos_stops:
        generator.top_eos_stops, generator.nbest_wanted = True, nbest
    return True


def leave_lean_beam_loop(generator) -> bool:
    """Undo :func:`use_lean_beam_loop`: fairseq's SequenceGenerator again; returns whether it was switched."""
    if type(generator) is not LeanBeamLoop:
        return False
    generator.__class__ = SequenceGenerator
    for name in ("top_eos_stops", "nbest_wanted"):
        vars(generator).pop(name, None)
    return True
