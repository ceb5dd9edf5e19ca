"""DecodingState (sequence_generators/state.py) on the buffers of real decoding steps, with rows of one
length (greedy, beam searches) and with per-row lengths (blockwise decoding).

States are built as the generator builds them (bos rows, the encoder output
and an incremental cache of the toy transformer) and grown with the runner's
own steps, so every per-row field has the shape a decoder gives it.
"""

from types import SimpleNamespace

import pytest
import torch

from fairseq_fastgen.counters import GenerationCounters
from fairseq_fastgen.sequence_generators.generator import DecodeContext
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
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


# ---- per-row lengths (blockwise decoding: rows accept different numbers of tokens) -----------------
PAD = 1


def row_state(toy, ids, steps, capacity=8):
    """A state of ``ids`` after ``steps`` greedy steps, given per-row lengths and room for ``capacity`` tokens."""
    return greedy_steps(new_state(toy, ids), steps).use_row_lengths(capacity, PAD)


def test_use_row_lengths_keeps_every_row_and_makes_room(toy):
    """Per-row lengths: the same tokens, scores and attention, then padding columns up to the room."""
    plain = greedy_steps(new_state(toy, [0, 1, 2]), 2)
    rows = row_state(toy, [0, 1, 2], 2, capacity=6)
    assert rows.lengths.tolist() == [2, 2, 2] and rows.row_length(1) == 2
    assert rows.tokens.shape == (3, 7) and rows.cum_scores.shape == (3, 6) and rows.attn.shape == (3, rows.src_len, 6)
    assert torch.equal(rows.tokens[:, :3], plain.tokens) and (rows.tokens[:, 3:] == PAD).all()
    assert torch.equal(rows.cum_scores[:, :2], plain.cum_scores) and not rows.cum_scores[:, 2:].any()
    assert torch.equal(rows.attn[:, :, :2], plain.attn) and not rows.attn[:, :, 2:].any()
    assert torch.equal(rows.scores, plain.scores)
    with pytest.raises(ValueError):
        rows.length  # noqa: B018  (rows may differ: read lengths)


def test_append_with_per_row_lengths_takes_each_rows_accepted_prefix(toy):
    """A block of 3 tokens, rows accepting 1, 3 and 2 of them: each row's tokens, cumulative scores
    (one float addition per token after the row's own score) and attention land after its last token."""
    state = row_state(toy, [0, 1, 2], 1)
    before = state.scores.clone()
    src_len = state.src_len
    block = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    lprobs = torch.tensor([[-0.5, -0.25, -1.0], [-0.125, -2.0, -0.75], [-1.5, -0.5, -3.0]])
    attn = torch.rand(3, src_len, 3)
    accepted = torch.tensor([[True, False, False], [True, True, True], [True, True, False]])
    state.append(block, lprobs, attn, accepted)
    assert state.lengths.tolist() == [2, 4, 3]
    assert state.tokens[:, 2:5].tolist() == [[5, PAD, PAD], [8, 9, 10], [11, 12, PAD]]
    for row, count in enumerate([1, 3, 2]):
        running = before[row]
        for offset in range(count):
            running = running + lprobs[row, offset]
            assert torch.equal(state.cum_scores[row, 1 + offset], running), (row, offset)
            assert torch.equal(state.attn[row, :, 1 + offset], attn[row, :, offset]), (row, offset)
        assert torch.equal(state.scores[row], running)
    assert not state.cum_scores[0, 2:].any() and not state.attn[0, :, 2:].any()


def test_a_row_without_tokens_scores_zero(toy):
    """A row at length 0 (its bos only) holds no score yet."""
    state = row_state(toy, [0, 1, 2], 2)
    state.row_lengths = torch.tensor([0, 0, 2])
    assert state.scores.tolist()[:2] == [0.0, 0.0] and torch.equal(state.scores[2], state.cum_scores[2, 1])


def test_append_lone_row_is_bitwise_append(toy):
    """The lone-row form (Python scores) writes the bits of the tensor form."""
    one, other = row_state(toy, [3], 2), row_state(toy, [3], 2)
    lprobs = torch.randn(1, 3).log_softmax(dim=1)
    attn = torch.rand(1, one.src_len, 3)
    block = torch.tensor([[5, 6, 7]])
    one.append(block, lprobs, attn, torch.tensor([[True, True, False]]))
    other.append_lone_row(2, block[0, :2], lprobs[0, :2].tolist(), attn[0, :, :2].t())
    for name in ("tokens", "cum_scores", "attn", "row_lengths"):
        assert torch.equal(getattr(one, name), getattr(other, name)), name


def test_select_with_per_row_lengths_moves_lengths_and_extra(toy):
    state = row_state(toy, [0, 1, 2, 5], 2)
    state.append(torch.tensor([[5, 6]] * 4), torch.full((4, 2), -0.5), None,
                 torch.tensor([[True, False], [True, True], [False, False], [True, True]]))
    state.extra["proposals"] = torch.arange(8).view(4, 2)
    state.extra["first_attn"] = None
    before = {name: getattr(state, name).clone() for name in ("tokens", "cum_scores", "attn", "row_lengths")}
    index = torch.tensor([3, 1, 1])
    state.select(index)
    assert state.lengths.tolist() == [4, 4, 4] and state.sentence.tolist() == [5, 1, 1]
    for name, value in before.items():
        assert torch.equal(getattr(state, name), value[index]), name
    assert state.extra["proposals"].tolist() == [[6, 7], [2, 3], [2, 3]] and state.extra["first_attn"] is None
    assert state.encoder_out["encoder_out"][0].size(1) == 3


def test_concat_joins_rows_at_different_lengths(toy):
    """Per-row states at different lengths, rooms and source widths (streaming: a refill joining running
    rows): every row keeps its tokens, scores, attention, length and extra fields; the room is the widest;
    a state without an extra field has zeros there."""
    running = row_state(toy, [0, 1], 3, capacity=6)
    running.append(torch.tensor([[5, 6], [7, 8]]), torch.full((2, 2), -0.25), None,
                   torch.tensor([[True, True], [True, False]]))
    running.extra.update(proposals=torch.tensor([[4, 4], [5, 5]]), first_attn=torch.rand(2, running.src_len))
    joining = greedy_steps(new_state(toy, [2], max_len=[9]), 1).use_row_lengths(10, PAD)
    joining.extra.update(proposals=torch.tensor([[2, PAD]]), first_attn=None)
    extra = running.src_len - joining.src_len
    assert extra > 0
    merged = DecodingState.concat([running, joining])

    assert merged.rows == 3 and merged.lengths.tolist() == [5, 4, 1] and merged.pad == PAD
    assert merged.tokens.shape == (3, 11) and merged.cum_scores.shape == (3, 10)
    assert torch.equal(merged.tokens[:2, :7], running.tokens) and (merged.tokens[:2, 7:] == PAD).all()
    assert torch.equal(merged.tokens[2], joining.tokens[0])
    assert torch.equal(merged.cum_scores[:2, :6], running.cum_scores) and not merged.cum_scores[:2, 6:].any()
    assert torch.equal(merged.cum_scores[2], joining.cum_scores[0])
    assert torch.equal(merged.scores, torch.cat([running.scores, joining.scores]))
    assert merged.attn.shape == (3, running.src_len, 10)
    assert torch.equal(merged.attn[:2, :, :6], running.attn) and not merged.attn[:2, :, 6:].any()
    assert torch.equal(merged.attn[2, extra:], joining.attn[0]) and not merged.attn[2, :extra].any()
    assert merged.extra["proposals"].tolist() == [[4, 4], [5, 5], [2, PAD]]
    assert torch.equal(merged.extra["first_attn"][:2], running.extra["first_attn"])
    assert not merged.extra["first_attn"][2].any()
    assert merged.sentence.tolist() == [0, 1, 2] and merged.max_len.tolist() == [10, 11, 9]
    assert merged.encoder_out["encoder_padding_mask"][0][2, :extra].all()
    for buffers in merged.cache.values():
        assert all(value.size(0) == 3 for value in buffers.values() if value is not None)
    with pytest.raises(ValueError):
        DecodingState.concat([running, new_state(toy, [3])])  # with and without per-row lengths


def test_hypothesis_reads_a_rows_own_length(toy):
    """DecodeContext.hypothesis of a row of a per-row state == that of the same row grown without them."""
    plain, rows = greedy_steps(new_state(toy, [0, 1]), 2), row_state(toy, [0, 1], 2)
    with torch.no_grad():
        lprobs, attn = plain.runner.step(plain.tokens, plain.encoder_out, plain.cache)  # the third step
    best, token = lprobs.max(dim=1, keepdim=True)  # (rows, 1) each
    plain.append(token, best, attn.unsqueeze(2))
    # the same token as a block of two, row 0 accepting it, row 1 nothing
    rows.append(token.expand(-1, 2), best.expand(-1, 2), attn.unsqueeze(2).expand(-1, -1, 2),
                torch.tensor([[True, False], [False, False]]))
    ctx = DecodeContext(None, [], SimpleNamespace(size=2), toy.task.target_dictionary.eos(), 1.0, True, 1,
                        GenerationCounters("test"))
    want, got = ctx.hypothesis(plain, 0), ctx.hypothesis(rows, 0)
    for name in ("tokens", "score", "positional_scores", "attention"):
        assert torch.equal(got[name], want[name]), name
    assert ctx.hypothesis(rows, 1)["tokens"].tolist() == plain.tokens[1, 1:3].tolist()


def test_candidate_rows_continue_rows_by_one_token(toy):
    """A beam step's candidates ending in eos, as a state of their own for DecodeContext.hypothesis."""
    state = greedy_steps(new_state(toy, [0, 1, 2]), 2)
    eos = toy.task.target_dictionary.eos()
    parents, scores, attn = torch.tensor([2, 0]), torch.tensor([-3.0, -4.5]), torch.rand(2, state.src_len)
    candidates = state.candidate_rows(parents, torch.full((2,), eos), scores, attn)
    assert candidates.rows == 2 and candidates.length == 3 and candidates.sentence.tolist() == [2, 0]
    assert torch.equal(candidates.tokens[:, :3], state.tokens[parents]) and (candidates.tokens[:, 3] == eos).all()
    assert torch.equal(candidates.cum_scores[:, :2], state.cum_scores[parents])
    assert torch.equal(candidates.scores, scores)
    assert torch.equal(candidates.attn, torch.cat([state.attn[parents], attn.unsqueeze(2)], dim=2))
    assert candidates.encoder_out is None and candidates.cache is None
