"""``--stop-at-top-eos``: stock beam search whose sentences end once their best candidate has been eos.

Up to the step a sentence ends, its search is stock's: at batch 1 (no companions leaving at other steps) its
hypotheses are the first ones stock's search ends, bitwise, in fewer decoder steps.  ``--nbest`` hypotheses are
always there.  Without length normalization (``--unnormalized``) the best hypothesis is stock's.  The rule lives
in the plugin's loop: with ``--no-lean-beam-loop`` it is refused in one line.
"""

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.fastseq import optimize_stock_generator
from fairseq_fastgen.options import parse_options
from tests.fastseq.test_beam_loop import generator
from tests.fastseq.test_shared_cache import BATCH_1_IDS


def counted_rows(built) -> list:
    """A list that gets the rows of each decoder step ``built``'s ensemble runs from now on."""
    rows, forward_decoder = [], built.model.forward_decoder

    def counting_forward_decoder(tokens, encoder_outs, incremental_states, temperature=1.0):
        rows.append(tokens.size(0))
        return forward_decoder(tokens, encoder_outs, incremental_states, temperature)

    built.model.forward_decoder = counting_forward_decoder
    return rows


def key(hypothesis):
    return (tuple(hypothesis["tokens"].tolist()), hypothesis["score"].item(),
            tuple(hypothesis["positional_scores"].tolist()))


def test_a_sentence_ends_with_the_first_hypotheses_stock_ends(loaded_toy, translate):
    stock_generator = generator(loaded_toy, lean=True, beam=5)
    early_generator = generator(loaded_toy, lean=True, beam=5, stop_at_top_eos=True)
    stock_rows, early_rows = counted_rows(stock_generator), counted_rows(early_generator)
    stock = translate(loaded_toy, stock_generator, 1, keep_ids=BATCH_1_IDS)
    early = translate(loaded_toy, early_generator, 1, keep_ids=BATCH_1_IDS)
    assert early.keys() == stock.keys()
    shorter = 0
    for sentence, hypotheses in early.items():
        assert 1 <= len(hypotheses) <= len(stock[sentence]) == 5
        stock_keys = {key(h) for h in stock[sentence]}
        assert all(key(h) in stock_keys for h in hypotheses), sentence  # stock's hypotheses, bitwise
        scores = [h["score"].item() for h in hypotheses]
        assert scores == sorted(scores, reverse=True)  # best first, as fairseq orders them
        shorter += len(hypotheses) < 5
    assert shorter > len(early) // 2  # most sentences stop before five hypotheses have ended
    assert sum(early_rows) < sum(stock_rows)
    same_best = sum(torch.equal(early[s][0]["tokens"], stock[s][0]["tokens"]) for s in early)
    assert same_best > len(early) // 2


@pytest.mark.parametrize("nbest", [1, 3])
def test_every_sentence_keeps_nbest_hypotheses(loaded_toy, translate, nbest):
    early = translate(loaded_toy, generator(loaded_toy, lean=True, beam=5, stop_at_top_eos=True, nbest=nbest), 32)
    assert len(early) == 200
    counts = [len(hypotheses) for hypotheses in early.values()]
    assert min(counts) >= nbest and min(counts) < 5


def test_the_rule_needs_the_plugins_loop(loaded_toy):
    config = GenerationConfig(beam=4, stop_at_top_eos=True, no_lean_beam_loop=True)
    built = generator(loaded_toy, lean=False)
    with pytest.raises(ValueError, match="^--stop-at-top-eos is a rule of the plugin's beam loop: drop "
                                         "--no-lean-beam-loop$"):
        optimize_stock_generator(built, parse_options(config).common)


def test_without_length_normalization_the_best_hypothesis_is_stocks(loaded_toy, translate):
    """--unnormalized: a hypothesis's score only falls as it grows, so once the best candidate has ended no
    later one scores higher: every sentence's best hypothesis is stock's, bitwise, in fewer steps."""
    stock_generator = generator(loaded_toy, lean=True, beam=5, unnormalized=True)
    early_generator = generator(loaded_toy, lean=True, beam=5, unnormalized=True, stop_at_top_eos=True)
    stock_rows, early_rows = counted_rows(stock_generator), counted_rows(early_generator)
    stock = translate(loaded_toy, stock_generator, 1, keep_ids=BATCH_1_IDS)
    early = translate(loaded_toy, early_generator, 1, keep_ids=BATCH_1_IDS)
    assert all(key(early[s][0]) == key(stock[s][0]) for s in stock)
    assert sum(early_rows) < sum(stock_rows)
