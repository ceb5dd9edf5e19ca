"""The step processors (sequence_generators/processors.py) on hand-built lprobs and states.

Each processor is held to the rule of fairseq's SequenceGenerator._generate it
reproduces (fairseq/sequence_generator.py, the body of the step loop):

    lprobs[lprobs != lprobs] = -inf                        # NaN never wins
    lprobs[:, pad] = -inf
    lprobs[:, unk] -= unk_penalty
    if step >= max_len: every column but eos = -inf
    if prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len:
        rows whose prefix token is not pad: every column but that token = -inf
    else:
        if step < min_len: lprobs[:, eos] = -inf
    no-repeat n-gram blocking (NGramRepeatBlock)

``step`` counts the tokens generated so far (the state's ``length``).  The plugin
applies ``max_len`` per row (per sentence); the references below apply fairseq's
rule to each row with that row's limit.  Expected values are written out by hand
or computed by ``fairseq_rules``, a transcription of the lines above, and by
fairseq's own NGramRepeatBlock.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.ngram_repeat_block import NGramRepeatBlock

from fairseq_fastgen.sequence_generators.processors import (
    BanRepeatedNgrams, ForbidPad, ForcePrefix, LengthLimits, StepRows, UnkPenalty, apply_processors,
    build_processors, row_max_len,
)
from fairseq_fastgen.sequence_generators.state import DecodingState

PAD, EOS, UNK = 1, 2, 3  # fairseq's Dictionary
BOS = EOS  # the decoder's first token is eos
VOCAB = 12
INF = math.inf


def lprobs_of(rows, seed=0):
    """Distinct negative scores (rows, VOCAB)."""
    return -torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) - 0.1


def state_of(generated, sentence=None, max_len=None):
    """The rows of a DecodingState of bos + ``generated`` (rows, step) tokens, as processors read them; no model
    behind it."""
    tokens = torch.tensor(generated, dtype=torch.long).reshape(len(generated), -1)
    tokens = torch.cat([torch.full((tokens.size(0), 1), BOS), tokens], dim=1)
    rows = tokens.size(0)
    sentence = torch.tensor(sentence if sentence is not None else list(range(rows)))
    max_len = torch.tensor(max_len if max_len is not None else [100] * rows)
    return StepRows.of_state(DecodingState(None, tokens, sentence, max_len, None, None, 0))


def fairseq_rules(lprobs, tokens, step, max_len, prefix=None, min_len=1, unk_penalty=0.0, ngram=0):
    """One row's lprobs (1, vocab) after fairseq's step rules (see the module docstring)."""
    lprobs = lprobs.clone()
    lprobs[lprobs != lprobs] = -INF
    lprobs[:, PAD] = -INF
    lprobs[:, UNK] -= unk_penalty
    if step >= max_len:
        lprobs[:, :EOS] = -INF
        lprobs[:, EOS + 1:] = -INF
    if prefix is not None and step < prefix.size(1) and step < max_len:
        token = prefix[:, step]
        if token.ne(PAD).all():
            kept = lprobs.gather(-1, token.unsqueeze(-1))
            lprobs[:] = -INF
            lprobs.scatter_(-1, token.unsqueeze(-1), kept)
    elif step < min_len:
        lprobs[:, EOS] = -INF
    if ngram > 0:
        NGramRepeatBlock(ngram, use_extension=False)(tokens, lprobs, 1, 1, step)
    return lprobs


# ---- one processor at a time ---------------------------------------------------------------------

def test_forbid_pad_bans_pad_and_nan():
    lprobs = lprobs_of(2)
    lprobs[0, 4], lprobs[1, 7], lprobs[1, 8] = math.nan, -INF, math.nan
    want = lprobs.clone()
    want[0, 4] = want[1, 8] = -INF
    want[:, PAD] = -INF
    ForbidPad(PAD)(lprobs, state_of([[5], [6]]))
    assert torch.equal(lprobs, want)


def test_unk_penalty_subtracts_from_unk_only():
    lprobs = lprobs_of(3)
    want = lprobs.clone()
    want[:, UNK] = want[:, UNK] - 1.5
    UnkPenalty(UNK, 1.5)(lprobs, state_of([[5], [6], [7]]))
    assert torch.equal(lprobs, want)


@pytest.mark.parametrize("step", range(5))
def test_min_length_bans_eos_before_it(step):
    """min_len 3: eos is -inf at steps 0, 1, 2 and free from step 3 on; nothing else changes."""
    lprobs = lprobs_of(2, seed=step)
    want = lprobs.clone()
    if step < 3:
        want[:, EOS] = -INF
    LengthLimits(EOS, min_len=3)(lprobs, state_of([[5] * step, [6] * step]))
    assert torch.equal(lprobs, want)


@pytest.mark.parametrize("step,eos_banned", [(0, False), (1, False), (2, True), (3, False)])
def test_min_length_does_not_apply_while_a_prefix_is_forced(step, eos_banned):
    """fairseq's min-length rule sits in the ``else`` of the prefix branch: with a 2-token prefix and
    min_len 3 it bans eos at step 2 only."""
    lprobs = lprobs_of(1, seed=step)
    LengthLimits(EOS, min_len=3, prefix_len=2)(lprobs, state_of([[5] * step]))
    assert (lprobs[0, EOS] == -INF) == eos_banned


def test_max_length_forces_eos_at_each_rows_limit():
    """Step 3, rows limited to 2, 3 and 5 tokens: the first two may only end (eos at its own score)."""
    lprobs = lprobs_of(3)
    want = lprobs.clone()
    want[:2] = -INF
    want[:2, EOS] = lprobs[:2, EOS]
    LengthLimits(EOS, min_len=1)(lprobs, state_of([[5, 6, 7]] * 3, max_len=[2, 3, 5]))
    assert torch.equal(lprobs, want)


def test_length_limits_at_steps_of_their_own():
    """``at_steps`` (each row at its own step) and ``at_consecutive_steps`` (one row over several
    steps) give each row what ``__call__`` (held to fairseq's rule above) gives it at its step."""
    limits = LengthLimits(EOS, min_len=3, prefix_len=1)
    steps, max_len = [0, 1, 2, 3, 4, 5], [9, 9, 9, 3, 9, 4]
    lprobs = lprobs_of(6)
    got = lprobs.clone()
    limits.at_steps(got, torch.tensor(steps), torch.tensor(max_len))
    for row, (step, limit) in enumerate(zip(steps, max_len)):
        expected = lprobs[row:row + 1].clone()
        limits(expected, state_of([[5] * step], max_len=[limit]))
        assert torch.equal(got[row:row + 1], expected), row
    assert got[1, EOS] == -INF and got[0, EOS] == lprobs[0, EOS]  # step 0 is the prefix's: no min length
    assert torch.isinf(got[3]).sum() == VOCAB - 1 and torch.isinf(got[5]).sum() == VOCAB - 1

    one_row = lprobs_of(6, seed=1)
    for first, count, limit in ((0, 6, 4), (2, 3, 9), (4, 2, 3)):
        got = one_row[:count].clone()
        limits.at_consecutive_steps(got, first, limit)
        for i in range(count):
            expected = one_row[i:i + 1].clone()
            limits(expected, state_of([[5] * (first + i)], max_len=[limit]))
            assert torch.equal(got[i:i + 1], expected), (first, i)


def test_force_prefix_keeps_only_the_prefix_token():
    """Sentences with prefixes [7, 5] and [6] (pad-filled): rows 0 and 2 of sentence 0, row 1 of
    sentence 1.  Each forced row keeps only its token, at its own score; a pad in the prefix, a step
    past the prefix or a row at its length limit forces nothing."""
    prefix = torch.tensor([[7, 5], [6, PAD]])
    force = ForcePrefix(prefix, PAD)
    lprobs = lprobs_of(3)
    got = lprobs.clone()
    force(got, state_of([[], [], []], sentence=[0, 1, 0]))
    for row, token in ((0, 7), (1, 6), (2, 7)):
        assert got[row, token] == lprobs[row, token]
        assert torch.isinf(got[row]).sum() == VOCAB - 1

    got = lprobs.clone()
    force(got, state_of([[7], [6], [7]], sentence=[0, 1, 0], max_len=[5, 5, 1]))
    want = lprobs.clone()
    want[0] = -INF
    want[0, 5] = lprobs[0, 5]
    assert torch.equal(got, want)  # row 1: pad; row 2: at its limit

    got = lprobs.clone()
    force(got, state_of([[7, 5], [6, 8], [7, 5]], sentence=[0, 1, 0]))
    assert torch.equal(got, lprobs)


@pytest.mark.parametrize("n,generated,banned", [
    (2, [5, 6, 5], {6}),  # bigram (5, 6) seen: 6 may not follow the last 5
    (2, [5, 6, 7, 5, 8, 5], {6, 8}),
    (2, [5, 6, 7], set()),  # 7 never seen before
    (3, [5, 6, 7, 5, 6], {7}),
    (3, [5, 6, 7, 6, 5], set()),  # (6, 5) never seen: the order matters
    (3, [5, 5, 5], {5}),
    (2, [5, 9, EOS], {5}),  # bos (= eos) counts: the bigram (bos, 5) was the first one
])
def test_ban_repeated_ngrams_bans_exactly_the_repeated_continuations(n, generated, banned):
    """Tokens that would complete an n-gram already generated (bos included) are banned, no other."""
    lprobs = lprobs_of(1)
    got = lprobs.clone()
    BanRepeatedNgrams(n)(got, state_of([generated]))
    assert {int(t) for t in torch.nonzero(got[0] == -INF)} == banned
    assert torch.equal(got[got != -INF], lprobs[got != -INF])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ban_repeated_ngrams_is_fairseqs_ngram_repeat_block(n):
    """Random histories over a 4-token alphabet (many repeats), every step: fairseq's CPU blocker."""
    generator = torch.Generator().manual_seed(n)
    history = torch.randint(4, 8, (6, 10), generator=generator)
    for step in range(11):
        lprobs = lprobs_of(6, seed=step)
        state = state_of(history[:, :step].tolist() if step else [[]] * 6)
        want = lprobs.clone()
        NGramRepeatBlock(n, use_extension=False)(state.tokens, want, 6, 1, step)
        got = lprobs.clone()
        BanRepeatedNgrams(n)(got, state)
        assert torch.equal(got, want), step


# ---- all of them, as the generator builds them --------------------------------------------------

def generation(**options):
    defaults = dict(unkpen=0.0, min_len=1, no_repeat_ngram_size=0, max_len_a=0.0, max_len_b=200)
    return SimpleNamespace(**{**defaults, **options})


def test_build_processors_follows_the_options_in_stock_order():
    tgt_dict = Dictionary()
    assert (tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()) == (PAD, EOS, UNK)
    plain = build_processors(tgt_dict, generation())
    assert [type(p) for p in plain] == [ForbidPad, LengthLimits]
    assert plain[1].min_len == 1 and plain[1].prefix_len == 0

    prefix = torch.tensor([[7, 5]])
    every = build_processors(tgt_dict, generation(unkpen=0.5, min_len=4, no_repeat_ngram_size=3), prefix)
    assert [type(p) for p in every] == [ForbidPad, UnkPenalty, LengthLimits, ForcePrefix, BanRepeatedNgrams]
    assert every[1].penalty == 0.5 and every[2].min_len == 4 and every[2].prefix_len == 2 and every[4].n == 3
    assert [type(p) for p in build_processors(tgt_dict, generation(), prefix[:, :0])] == [ForbidPad, LengthLimits]


def test_processors_together_are_fairseqs_step_rules():
    """Every option at once, steps 0 to 7, rows of two sentences (one with a shorter, pad-filled
    prefix) and per-row limits, NaNs in the scores: each row as fairseq's rules leave it.  Every
    row's limit is at least min_len, as fairseq asserts of its (batch-wide) limit."""
    prefix = torch.tensor([[7, 5], [8, PAD]])
    sentence, max_len = [0, 0, 1, 1], [6, 4, 5, 7]
    processors = build_processors(Dictionary(), generation(unkpen=0.75, min_len=4, no_repeat_ngram_size=2), prefix)
    history = torch.randint(4, 9, (4, 8), generator=torch.Generator().manual_seed(3))
    for step in range(8):
        lprobs = lprobs_of(4, seed=10 + step)
        lprobs[step % 4, (step * 5) % VOCAB] = math.nan
        state = state_of(history[:, :step].tolist() if step else [[]] * 4, sentence, max_len)
        got = apply_processors(processors, lprobs.clone(), state)
        want = torch.cat([
            fairseq_rules(lprobs[r:r + 1], state.tokens[r:r + 1], step, max_len[r], prefix[sentence[r]:sentence[r] + 1],
                          min_len=4, unk_penalty=0.75, ngram=2)
            for r in range(4)
        ])
        assert torch.equal(got, want), step


def test_row_max_len_is_fairseqs_limit_per_sentence():
    """min(int(max_len_a * src_len + max_len_b), max_positions - 1), each sentence with its own length."""
    src_lengths = torch.tensor([3, 7, 100, 1])
    got = row_max_len(src_lengths, generation(max_len_a=1.5, max_len_b=10), max_positions=64)
    assert got.tolist() == [min(int(1.5 * s + 10), 63) for s in (3, 7, 100, 1)] == [14, 20, 63, 11]


def test_row_max_len_rounds_as_fairseq():
    """fairseq computes the limit in Python's double precision: int(0.7 * 90) is 62 (63 in float32)."""
    got = row_max_len(torch.tensor([90]), generation(max_len_a=0.7, max_len_b=0), max_positions=1024)
    assert got.tolist() == [int(0.7 * 90)]
