"""DecodingState (sequence_generators/state.py) on the buffers of real decoding steps.

States are built as the generator builds them (bos rows, the encoder output
and an incremental cache of the toy transformer) and grown with the runner's
own steps, so every per-row field has the shape a decoder gives it.
"""

import pytest
import torch

from fairseq_fastgen.sequence_generators.runner import ModelRunner
from fairseq_fastgen.sequence_generators.state import DecodingState
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)

CLOSE = dict(atol=1e-5, rtol=0)


def new_state(toy, ids, max_len=None):
    """A state of the sentences ``ids`` before any step, as ``generator.py`` starts one."""
    runner = ModelRunner(toy.models[0])
    sample = toy.sample(ids)
    rows = len(ids)
    eos = toy.task.target_dictionary.eos()
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
    bos = torch.full((rows, 1), eos, dtype=torch.long)
    max_len = torch.tensor(max_len if max_len is not None else [10 + i for i in range(rows)])
    return DecodingState(runner, bos, torch.tensor(ids), max_len, encoder_out, runner.new_cache(),
                         sample["net_input"]["src_tokens"].size(1))


def greedy_steps(state, steps):
    """``steps`` greedy steps through the runner, appended one by one."""
    with torch.no_grad():
        for _ in range(steps):
            lprobs, attn = state.runner.step(state.tokens, state.encoder_out, state.cache)
            best, token = lprobs.max(dim=1)
            state.append(token.unsqueeze(1), best.unsqueeze(1), attn.unsqueeze(2))
    return state


def test_a_new_state_holds_only_bos(toy):
    state = new_state(toy, [0, 1, 2])
    assert state.rows == 3 and state.length == 0
    assert state.cum_scores.shape == (3, 0) and state.attn is None
    assert torch.equal(state.scores, torch.zeros(3))


def test_append_one_token_grows_tokens_scores_and_attention(toy):
    """One token per row: tokens grow by a column, the cumulative score by one addition, the attention
    by a column of (rows, src_len)."""
    state = new_state(toy, [0, 1])
    src_len = state.src_len
    attn1, attn2 = torch.rand(2, src_len, 1), torch.rand(2, src_len, 1)
    state.append(torch.tensor([[5], [6]]), torch.tensor([[-0.5], [-1.25]]), attn1)
    state.append(torch.tensor([[7], [8]]), torch.tensor([[-0.25], [-2.0]]), attn2)
    assert state.length == 2
    assert state.tokens.tolist() == [[2, 5, 7], [2, 6, 8]]
    assert state.cum_scores.tolist() == [[-0.5, -0.75], [-1.25, -3.25]]
    assert state.scores.tolist() == [-0.75, -3.25]
    assert torch.equal(state.attn, torch.cat([attn1, attn2], dim=2))


def test_append_without_attention_keeps_none(toy):
    state = new_state(toy, [0])
    state.append(torch.tensor([[5]]), torch.tensor([[-1.0]]))
    assert state.attn is None and state.tokens.tolist() == [[2, 5]]


def test_append_a_block_accumulates_each_position(toy):
    """Several tokens at once (blockwise decoding): the cumulative score after each of them."""
    state = new_state(toy, [0, 1])
    state.append(torch.tensor([[5], [6]]), torch.tensor([[-1.0], [-0.5]]))
    state.append(torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([[-0.5, -0.25, -2.0], [0.0, -1.0, -0.125]]))
    assert state.length == 4 and state.tokens[:, 2:].tolist() == [[7, 8, 9], [10, 11, 12]]
    assert state.cum_scores.tolist() == [[-1.0, -1.5, -1.75, -3.75], [-0.5, -0.5, -1.5, -1.625]]


def test_select_moves_every_row_field_together(toy):
    """``select`` with an index that reorders, repeats and drops rows: tokens, scores, attention,
    sentence, max_len, the encoder output's rows and every cached tensor's rows follow the index."""
    state = greedy_steps(new_state(toy, [0, 1, 2, 5]), 2)
    index = torch.tensor([2, 0, 0, 3])
    before = {
        "tokens": state.tokens.clone(), "cum_scores": state.cum_scores.clone(), "attn": state.attn.clone(),
        "sentence": state.sentence.clone(), "max_len": state.max_len.clone(),
    }
    encoder = {k: [t.clone() for t in v] for k, v in state.encoder_out.items()}
    cache = {key: {n: v.clone() for n, v in b.items() if v is not None} for key, b in state.cache.items()}
    assert len(cache) == 4  # self- and encoder-decoder attention of the toy's two layers

    state.select(index)
    for field, value in before.items():
        assert torch.equal(getattr(state, field), value.index_select(0, index)), field
    assert state.sentence.tolist() == [2, 0, 0, 5]
    assert torch.equal(state.encoder_out["encoder_out"][0], encoder["encoder_out"][0][:, index])
    assert torch.equal(state.encoder_out["encoder_padding_mask"][0], encoder["encoder_padding_mask"][0][index])
    for key, buffers in cache.items():
        for name, value in buffers.items():
            assert torch.equal(state.cache[key][name], value[index]), (key, name)


def test_a_step_after_select_continues_the_selected_rows(toy):
    """After ``select`` the next step of every row is the one its source row would have taken."""
    kept = greedy_steps(new_state(toy, [0, 1, 2, 5]), 2)
    untouched = greedy_steps(new_state(toy, [0, 1, 2, 5]), 2)
    index = torch.tensor([3, 1, 1])
    kept.select(index)
    with torch.no_grad():
        got, _ = kept.runner.step(kept.tokens, kept.encoder_out, kept.cache)
        want, _ = untouched.runner.step(untouched.tokens, untouched.encoder_out, untouched.cache)
    assert torch.allclose(got, want[index], **CLOSE)
    assert torch.equal(got.argmax(1), want[index].argmax(1))


def test_replace_tokens_sets_the_history(toy):
    state = new_state(toy, [0, 1])
    tokens, scores = torch.tensor([[2, 9], [2, 4]]), torch.tensor([[-1.0], [-2.0]])
    attn = torch.rand(2, state.src_len, 1)
    state.replace_tokens(tokens, scores)
    assert state.tokens is tokens and state.cum_scores is scores and state.attn is None
    state.replace_tokens(tokens, scores, attn)
    assert state.attn is attn and state.length == 1 and state.scores.tolist() == [-1.0, -2.0]


def test_concat_merges_two_cohorts(toy):
    """Two cohorts of different source widths, two steps each: the merged state holds the rows of
    both in order, the narrower cohort's attention and encoder output left-padded to the wider
    source, and its next step gives every row its own cohort's lprobs."""
    wide = greedy_steps(new_state(toy, [0, 1], max_len=[7, 8]), 2)
    narrow = greedy_steps(new_state(toy, [2], max_len=[9]), 2)
    extra = wide.src_len - narrow.src_len
    assert extra > 0
    merged = DecodingState.concat([wide, narrow])

    assert merged.rows == 3 and merged.length == 2 and merged.src_len == wide.src_len
    assert torch.equal(merged.tokens, torch.cat([wide.tokens, narrow.tokens]))
    assert torch.equal(merged.cum_scores, torch.cat([wide.cum_scores, narrow.cum_scores]))
    assert merged.sentence.tolist() == [0, 1, 2] and merged.max_len.tolist() == [7, 8, 9]
    assert merged.attn.shape == (3, wide.src_len, 2)
    assert torch.equal(merged.attn[:2], wide.attn)
    assert torch.equal(merged.attn[2, extra:], narrow.attn[0]) and not merged.attn[2, :extra].any()
    assert merged.encoder_out["encoder_padding_mask"][0][2, :extra].all()

    with torch.no_grad():
        together, _ = merged.runner.step(merged.tokens, merged.encoder_out, merged.cache)
        apart = torch.cat([wide.runner.step(wide.tokens, wide.encoder_out, wide.cache)[0],
                           narrow.runner.step(narrow.tokens, narrow.encoder_out, narrow.cache)[0]])
    assert torch.allclose(together, apart, **CLOSE)


def test_concat_refuses_states_of_different_lengths(toy):
    with pytest.raises(ValueError):
        DecodingState.concat([greedy_steps(new_state(toy, [0]), 1), greedy_steps(new_state(toy, [1]), 2)])
