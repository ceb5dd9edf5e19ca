"""Stock beam search through the plugin's lean loop gives stock fairseq's hypotheses, bitwise.

Stock fairseq's loop (``--no-lean-beam-loop``) and the lean loop run in one process
on the same models; tokens, scores, positional scores and attention of every
hypothesis must be equal.  The toy's target vocabulary (1,872 symbols) is 29 chunks
and a partial one, so the chunked candidate search runs, its tail included.
"""

import math

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.sequence_generator import SequenceGenerator, SequenceGeneratorWithAlignment

from fairseq_fastgen.fastseq import LeanBeamLoop, optimize_stock_generator, use_lean_beam_loop
from fairseq_fastgen.fastseq.beam_loop import CHUNK, mask_nan_, top_candidates
from fairseq_fastgen.options import parse_options
from tests.fastseq.test_shared_cache import BATCH_1_IDS, assert_bitwise_equal, random_transformer


def generator(loaded, lean, shared_cache=False, models=None, **options):
    config = GenerationConfig(
        beam=options.pop("beam", 4), max_len_b=options.pop("max_len_b", 200),
        no_shared_encoder_cache=not shared_cache, no_lean_beam_loop=not lean, **options,
    )
    return loaded.task.build_generator(models or loaded.models, config)


def first_batch(loaded):
    """The first 8 test sentences as fairseq collates them."""
    return next(iter(loaded.task.get_batch_iterator(
        loaded.dataset, max_sentences=8, disable_iterator_cache=True).next_epoch_itr(shuffle=False)))


def test_the_plugin_switches_stock_beam_search_to_the_lean_loop(loaded_toy):
    lean = generator(loaded_toy, lean=True)
    assert type(lean) is LeanBeamLoop
    sample = first_batch(loaded_toy)
    assert lean.lean_loop_applies(sample, None, None)  # the tests below run the lean loop, not its fallback
    assert not lean.lean_loop_applies(sample, sample["target"][:, :1], None)
    assert type(generator(loaded_toy, lean=False)) is SequenceGenerator


def test_subclasses_of_the_stock_generator_keep_their_own_loop(loaded_toy):
    aligning = SequenceGeneratorWithAlignment(loaded_toy.models, loaded_toy.task.target_dictionary, beam_size=4)
    assert not use_lean_beam_loop(aligning)
    assert type(aligning) is SequenceGeneratorWithAlignment


@pytest.mark.parametrize("batch_size", [1, 32])
@pytest.mark.parametrize("beam", [1, 4, 8])
def test_lean_loop_gives_stock_hypotheses(loaded_toy, translate, beam, batch_size):
    keep = BATCH_1_IDS if batch_size == 1 else None
    stock = translate(loaded_toy, generator(loaded_toy, lean=False, beam=beam), batch_size, keep_ids=keep)
    lean = translate(loaded_toy, generator(loaded_toy, lean=True, beam=beam), batch_size, keep_ids=keep)
    assert len(stock) == (len(BATCH_1_IDS) if keep else 200)
    assert_bitwise_equal(stock, lean)


def test_lean_loop_with_length_limits_banning_penalties_and_nbest(loaded_toy, translate):
    """Sentences cut at max length, a minimum length, n-gram banning, unk penalty, length penalty,
    every finalized hypothesis returned, and the shared encoder cache with it."""
    options = dict(beam=5, max_len_b=9, min_len=3, no_repeat_ngram_size=2, unkpen=0.5, lenpen=0.6, nbest=5)
    stock = translate(loaded_toy, generator(loaded_toy, lean=False, **options), 32)
    lean = translate(loaded_toy, generator(loaded_toy, lean=True, shared_cache=True, **options), 32)
    assert any(len(h[0]["tokens"]) == 10 for h in stock.values())  # some hypotheses end at the limit
    assert all(len(h) == 5 for h in stock.values())
    assert_bitwise_equal(stock, lean)


def test_lean_loop_on_transformer_khead(loaded_khead, translate):
    """A k-head model through stock beam search decodes with head 1, in either loop."""
    stock = translate(loaded_khead, generator(loaded_khead, lean=False), 32)
    assert_bitwise_equal(stock, translate(loaded_khead, generator(loaded_khead, lean=True, shared_cache=True), 32))


def test_lean_loop_with_an_ensemble(loaded_toy, translate):
    models = [loaded_toy.models[0], random_transformer(loaded_toy, heads=8, seed=3)]
    # the untrained model rarely ends a sentence: 12 tokens at most keep the test short
    stock = translate(loaded_toy, generator(loaded_toy, lean=False, models=models, max_len_b=12), 32, models=models)
    lean = translate(loaded_toy, generator(loaded_toy, lean=True, models=models, max_len_b=12), 32, models=models)
    assert_bitwise_equal(stock, lean)


def test_prefix_tokens_run_through_the_stock_loop(loaded_toy):
    sample = first_batch(loaded_toy)
    prefix = sample["target"][:, :2]
    with torch.no_grad():
        stock = generator(loaded_toy, lean=False).generate(loaded_toy.models, sample, prefix_tokens=prefix)
        lean = generator(loaded_toy, lean=True).generate(loaded_toy.models, sample, prefix_tokens=prefix)
    assert_bitwise_equal(dict(enumerate(stock)), dict(enumerate(lean)))
    assert all(torch.equal(h[0]["tokens"][:2], p) for h, p in zip(lean, prefix))


def flat_topk(lprobs, prev_scores, k):
    """BeamSearch.step's computation: add each beam's score to all its entries, one top-k per sentence."""
    bsz, beams, vocab = lprobs.shape
    totals = lprobs if prev_scores is None else lprobs + prev_scores.unsqueeze(2)
    values, flat = totals.reshape(bsz, -1).topk(k, dim=1)
    return values, flat // vocab, flat % vocab


@pytest.mark.parametrize("vocab", [8008, 8000, 1872, 300])  # chunks and a tail; whole chunks; the toy's; too few
def test_top_candidates_equal_a_topk_over_beam_times_vocab(vocab):
    assert (vocab // CHUNK >= 10) == (vocab != 300)  # 300 takes the plain path
    torch.manual_seed(vocab)
    bsz, beams = 64, 5
    lprobs = torch.log_softmax(torch.randn(bsz * beams, vocab) * 3, dim=1)  # as the generator holds them
    lprobs[:, 1] = -math.inf  # pad
    lprobs[3 * beams:4 * beams, :] = -math.inf  # a sentence where only eos (2) is left, as at max length
    lprobs[3 * beams:4 * beams, 2] = -0.0
    lprobs[7 * beams + 2, :vocab // 2] = -math.inf  # a beam with half its entries banned
    prev = -torch.rand(bsz, beams) * 10
    prev[9, 4] = -math.inf  # a beam whose score fell to -inf
    by_beam = lprobs.view(bsz, beams, vocab)
    for step_prev, view in ((None, by_beam[:, :1, :]), (prev, by_beam)):
        k = 2 * beams
        expected = flat_topk(view, step_prev, k)
        got = top_candidates(view, step_prev, k)
        finite = expected[0].isfinite()
        assert torch.equal(got[0], expected[0])  # every value, -inf included, in order
        for got_part, expected_part in zip(got[1:], expected[1:]):  # the (beam, token) of every finite value
            assert torch.equal(got_part[finite], expected_part[finite])


def test_nan_entries_become_minus_infinity_and_nothing_else_changes():
    lprobs = torch.log_softmax(torch.randn(320, 8008), dim=1)
    lprobs[:, 1] = -math.inf
    clean = lprobs.clone()
    assert torch.equal(mask_nan_(lprobs), clean)
    lprobs[17, 40] = math.nan
    lprobs[200, :] = math.nan
    mask_nan_(lprobs)
    clean[17, 40] = -math.inf
    clean[200, :] = -math.inf
    assert torch.equal(lprobs, clean)


def test_the_switch_is_an_option_of_the_generation_config(loaded_toy):
    config = GenerationConfig(beam=4, no_lean_beam_loop=True)
    built = SequenceGenerator(loaded_toy.models, loaded_toy.task.target_dictionary, beam_size=4)
    assert type(optimize_stock_generator(built, parse_options(config).common)) is SequenceGenerator
    config.no_lean_beam_loop = False
    assert type(optimize_stock_generator(built, parse_options(config).common)) is LeanBeamLoop
