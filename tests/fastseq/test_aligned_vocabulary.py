"""A vocabulary whose size is not a multiple of 8 (a dictionary given as a file, as a 32k sentencepiece one of
32,003 symbols): the step engines write its logits in aligned rows (ops/aligned_rows.py) and still give stock
fairseq's hypotheses bitwise, tokens, scores, positional scores and attention."""

import copy

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.adapters.ensemble import restore_ensemble
from fairseq_fastgen.engine import fairseq_runner
from fairseq_fastgen.ops.aligned_rows import ALIGNED_FLOATS, aligns
from tests.fastseq.test_shared_cache import assert_bitwise_equal


@pytest.fixture(scope="module")
def odd_vocabulary(loaded_toy):
    """(task, model): the toy's task with three more target symbols and an untrained transformer of its shape."""
    task = copy.copy(loaded_toy.task)  # its datasets shared, its target dictionary its own
    task.tgt_dict = copy.deepcopy(task.tgt_dict)
    for extra in range(3):
        task.tgt_dict.add_symbol(f"<extra{extra}>")
    assert len(task.tgt_dict) % ALIGNED_FLOATS != 0
    torch.manual_seed(5)
    return task, task.build_model(copy.deepcopy(loaded_toy.cfg.model)).eval()


def generator(task, model, **options):
    # the untrained model rarely ends a sentence: 12 tokens at most keep the test short
    return task.build_generator([model], GenerationConfig(max_len_b=12, **options))


@pytest.mark.parametrize("decoder,beam,batch_size", [("greedy", 1, 32), ("beam", 4, 32), ("beam", 4, 3)])
def test_aligned_logits_give_stock_hypotheses(loaded_toy, translate, odd_vocabulary, monkeypatch, decoder, beam,
                                              batch_size):
    task, model = odd_vocabulary
    stock = generator(task, model, beam=beam, no_shared_encoder_cache=True, no_lean_beam_loop=True,
                      step_engine="fairseq")
    restore_ensemble(stock)  # fairseq's own ensemble and decoder calls: its output_layer, F.linear's product
    expected = translate(loaded_toy, stock, batch_size, models=[model])
    aligned_calls, aligned_rows_linear = [], fairseq_runner.aligned_rows_linear

    def counted(features, weight):
        aligned_calls.append(aligns(features, weight))
        return aligned_rows_linear(features, weight)

    monkeypatch.setattr(fairseq_runner, "aligned_rows_linear", counted)
    engine = generator(task, model, beam=beam, decoder=decoder, step_engine="static")
    assert_bitwise_equal(expected, translate(loaded_toy, engine, batch_size, models=[model]))
    assert aligned_calls and all(aligned_calls)  # every step's logits in aligned rows
