"""--step-engine static (engine/): bitwise the hypotheses of fairseq's own decoder step.

Every plugin decoder on the toy model, fp32 on the CPU, sentence by sentence:
tokens, scores, positional scores and attention equal with ``torch.equal``.
"""

import pytest
import torch

from fairseq_fastgen.engine import make_runner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.engine.runner_types import PlacesRows, Runner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.engine.static_cache import StaticCache
from tests.sequence_generators.test_var_beam import TEST_SENTENCES, assert_identical, toy  # noqa: F401  (fixture)

SENTENCES = list(range(0, TEST_SENTENCES, 2))  # 100 sentences of the toy test set


def decode(toy, ids, batch_size, prefix_size=0, **options):
    """{sentence id: hypotheses} over ``ids`` in generate() calls of ``batch_size`` sentences."""
    generator = toy.generator(**options)
    return generator, translate_batches(toy, generator, ids, batch_size, prefix_size)


def translate_batches(toy, generator, ids, batch_size, prefix_size=0):
    """{sentence id: hypotheses} of ``generator`` over ``ids`` in generate() calls of ``batch_size`` sentences."""
    results = {}
    for start in range(0, len(ids), batch_size):
        sample = toy.sample(ids[start : start + batch_size])
        prefix = sample["target"][:, :prefix_size] if prefix_size else None
        results.update(zip(sample["id"].tolist(), generator.generate(toy.models, sample, prefix_tokens=prefix)))
    return results


def assert_same_attention(expected, actual):
    for sentence, hypotheses in expected.items():
        for want, got in zip(hypotheses, actual[sentence]):
            assert torch.equal(got["attention"], want["attention"]), sentence


CASES = {
    "greedy": dict(decoder="greedy", beam=1),
    "var-batch-beam1": dict(decoder="var-batch", beam=1),
    "var-batch-beam4": dict(decoder="var-batch", beam=4),
    "var-batch-beam8": dict(decoder="var-batch", beam=8, nbest=3),
    "fixed-stream-beam4": dict(decoder="fixed-stream", beam=4),
    "var-stream-refills": dict(decoder="var-stream", beam=5, stream_capacity=6, stream_eps=1 / 6),
    "greedy-ngram2": dict(decoder="greedy", beam=1, no_repeat_ngram_size=2),
    "var-batch-ngram2": dict(decoder="var-batch", beam=4, no_repeat_ngram_size=2),
    "greedy-cut-at-max-len": dict(decoder="greedy", beam=1, max_len_a=0, max_len_b=3),
    "var-batch-cut-at-max-len": dict(decoder="var-batch", beam=4, max_len_a=0, max_len_b=4),
}


# batch 1 runs the three cheapest cases (a row's step has no arithmetic across rows)
BATCH_ONE = ("greedy", "var-batch-beam4", "greedy-cut-at-max-len")


@pytest.mark.parametrize(
    "case,batch_size", [(c, b) for c in CASES for b in (1, 7, 64) if b > 1 or c in BATCH_ONE]
)
def test_static_engine_is_bitwise_fairseq(toy, case, batch_size):
    ids = SENTENCES[:30] if batch_size == 1 else SENTENCES
    reference, expected = decode(toy, ids, batch_size, step_engine="fairseq", **CASES[case])
    engine, actual = decode(toy, ids, batch_size, step_engine="static", **CASES[case])
    assert type(reference.runner) is ModelRunner and type(engine.runner) is StaticRunner
    assert_identical(expected, actual)
    assert_same_attention(expected, actual)


@pytest.mark.parametrize("decoder,beam", [("greedy", 1), ("var-batch", 4)])
def test_static_engine_with_prefix_tokens(toy, decoder, beam):
    ids = SENTENCES[:40]
    _, expected = decode(toy, ids, 8, prefix_size=1, decoder=decoder, beam=beam, step_engine="fairseq")
    _, actual = decode(toy, ids, 8, prefix_size=1, decoder=decoder, beam=beam, step_engine="static")
    assert_identical(expected, actual)
    assert all(int(h[0]["tokens"][0]) == int(toy.sample([i])["target"][0, 0]) for i, h in actual.items())


def test_reorders_within_the_same_origins_leave_the_encoder_keys_in_place():
    """Beams changing places within their sentences: each row's encoder-decoder keys/values are a copy
    of the same first-step row as before, so they stay put; a reorder that changes any row's origin
    (a sentence leaves, a beam is duplicated across sentences) copies them as index_select would."""
    rows, heads, src_len, head_dim = 4, 2, 5, 3
    keys = [torch.randn(rows, heads, src_len, head_dim) for _ in range(2)]
    values = [torch.randn(rows, heads, src_len, head_dim) for _ in range(2)]
    mask = torch.zeros(rows, src_len, dtype=torch.bool)
    cache = StaticCache(capacity=8)
    cache.start(keys, values, mask, heads, head_dim)
    expand = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # 4 sentences, beam 2
    cache.select(expand)
    expanded = [k.index_select(0, expand) for k in keys]
    assert all(torch.equal(a, b) for a, b in zip(cache.cross_keys, expanded))
    kept = list(cache.cross_keys)
    cache.select(torch.tensor([1, 0, 2, 2, 5, 4, 7, 7]))  # every row keeps its sentence
    assert all(a is b for a, b in zip(cache.cross_keys, kept))
    assert cache.real_rows == 8
    shrink = torch.tensor([0, 1, 4, 5])  # sentences 1 and 3 finished
    cache.select(shrink)
    assert [k.size(0) for k in cache.cross_keys] == [4, 4]
    assert all(torch.equal(a, b.index_select(0, shrink)) for a, b in zip(cache.cross_keys, expanded))
    assert torch.equal(cache.cross_origin, torch.tensor([0, 0, 2, 2]))
    cache.select(torch.tensor([2, 2, 2, 3]))  # a row takes another sentence's place: copied
    assert torch.equal(cache.cross_keys[1], keys[1][torch.tensor([2, 2, 2, 2])])
    assert torch.equal(cache.cross_values[0], values[0][torch.tensor([2, 2, 2, 2])])


def test_row_origins_group_the_copies_of_a_sentences_encoder_output():
    """Neighbouring rows with equal encoder states and masks share an origin (a beam search's copies of one
    sentence); equal states with another mask, or equal rows that are not neighbours, do not."""
    sentences = torch.randn(3, 3, 4)  # (src_len, sentences, dim)
    states = sentences[:, [0, 0, 0, 1, 1, 0, 2, 2]]  # (src_len, rows, dim)
    mask = torch.zeros(8, 3, dtype=torch.bool)
    mask[4, 2] = True  # row 4: sentence 1's states under another padding mask
    assert StaticCache.row_origins(states, mask).tolist() == [0, 0, 0, 3, 4, 5, 6, 6]
    assert StaticCache.row_origins(states, None).tolist() == [0, 0, 0, 3, 3, 5, 6, 6]


def test_zero_unwritten_zeroes_the_tail_once_and_keeps_it_zero():
    """A cache of the eager forms leaves unwritten positions as they are (here NaN, then whatever a row
    selection's new buffers hold); before a padded step, zero_unwritten zeroes them, and a later row selection
    keeps them zero."""
    rows, heads, head_dim = 3, 2, 4
    cache = StaticCache(capacity=6)
    cache.start([torch.zeros(rows, heads, 5, head_dim)], [torch.zeros(rows, heads, 5, head_dim)], None, heads, head_dim)
    for buffer in cache.self_keys + cache.self_values:
        buffer.fill_(float("nan"))
        buffer[:, :, :2] = 1.0
    cache.length = 2
    cache.select(torch.tensor([2, 0]))
    assert not cache.zeroed and (cache.self_keys[0][:, :, :2] == 1).all()  # the tail: whatever memory held
    cache.zero_unwritten()
    assert cache.zeroed and (cache.self_values[0][:, :, 2:] == 0).all() and (cache.self_values[0][:, :, :2] == 1).all()
    cache.select(torch.tensor([1, 1, 0]))
    for buffer in cache.self_keys + cache.self_values:
        assert buffer.shape == (3, heads, 6, head_dim)
        assert (buffer[:, :, :2] == 1).all() and (buffer[:, :, 2:] == 0).all()


def test_positions_no_row_attends_are_dropped_from_the_front():
    """Rows that joined a stream later sit right-aligned behind padding; once the rows that held the first
    positions left, those positions are dropped (16 or more at once) and every row keeps its own keys/values
    and padding, moved left; fewer than 16 stay."""
    rows, heads, head_dim, length = 3, 2, 4, 40
    cache = StaticCache(capacity=48, zeroed=True)
    cache.start([torch.zeros(rows, heads, 5, head_dim)], [torch.zeros(rows, heads, 5, head_dim)], None, heads, head_dim)
    for buffer in cache.self_keys + cache.self_values:
        buffer[:, :, :length] = torch.randn(rows, heads, length, head_dim)
    cache.length = length
    cache.self_padding = torch.zeros(rows, 48, dtype=torch.bool)
    cache.self_padding[0, :20] = True  # row 0 attends positions 20..39
    cache.self_padding[1, :25] = True  # row 1: 25..39
    cache.self_padding[2, :10] = True  # row 2: 10..39
    keys = cache.self_keys[0].clone()
    cache.drop_leading_padding()
    assert cache.length == 40  # row 2 still attends position 10: only 10 unattended, fewer than 16
    cache.select(torch.tensor([0, 1]))  # row 2 left: positions 0..19 are attended by no row
    cache.drop_leading_padding()
    assert cache.length == 20
    assert torch.equal(cache.self_keys[0][:, :, :20], keys[:2, :, 20:40])
    assert cache.self_padding[:, :20].tolist() == [[False] * 20, [True] * 5 + [False] * 15]
    assert (cache.self_values[0][:, :, 20:] == 0).all()  # a zeroed cache stays zeroed past its length


def test_fresh_rows_take_finished_rows_places():
    """A refill's rows enter the rows finished ones left (streaming with --stream-join-lengths): the rows of the
    fresh cache named take the slots, their encoder-decoder keys/values and mask are copied in (the running rows'
    own stay), the positions written so far become padding for them only, and a zeroed cache keeps them zero.
    Both caches hold sources of one width (the stream widens both first); another width is refused."""
    heads, head_dim, length, width = 2, 4, 7, 6
    running = StaticCache(capacity=12, zeroed=True)
    running.start([torch.randn(4, heads, width, head_dim)], [torch.randn(4, heads, width, head_dim)], None, heads,
                  head_dim)
    for buffer in running.self_keys + running.self_values:
        buffer[:, :, :length] = torch.randn(4, heads, length, head_dim)
    running.length = length
    fresh = StaticCache(capacity=12)
    fresh_mask = torch.tensor([[False] * 6, [True, False, False, False, False, False], [False] * 4 + [True] * 2])
    fresh.start([torch.randn(3, heads, width, head_dim)], [torch.randn(3, heads, width, head_dim)], fresh_mask, heads,
                head_dim)
    before_keys, before_self = running.cross_keys[0].clone(), running.self_keys[0].clone()

    running.place(torch.tensor([3, 1]), fresh, torch.tensor([2, 0]))  # fresh row 2 into slot 3, row 0 into 1

    assert running.cross_keys[0].shape == (4, heads, width, head_dim)
    assert torch.equal(running.cross_keys[0][[3, 1]], fresh.cross_keys[0][[2, 0]])
    assert torch.equal(running.cross_values[0][[3, 1]], fresh.cross_values[0][[2, 0]])
    assert torch.equal(running.cross_keys[0][[0, 2]], before_keys[[0, 2]])  # the running rows' own keys
    assert running.cross_mask.tolist() == [[False] * 6, fresh_mask[0].tolist(), [False] * 6, fresh_mask[2].tolist()]
    assert running.self_padding[:, :length].tolist() == [[False] * length, [True] * length, [False] * length,
                                                         [True] * length]
    assert not running.self_padding[:, length:].any()  # the fresh rows' first step writes at position 7
    assert torch.equal(running.self_keys[0][[0, 2]], before_self[[0, 2]])
    assert (running.self_keys[0][[1, 3], :, :length] == 0).all()  # zeroed: released positions hold zeros
    assert len(set(running.cross_origin.tolist())) == 4  # no reorder takes a fresh row for a running one
    with pytest.raises(ValueError, match="another started cache"):
        running.place(torch.tensor([0]), running, torch.tensor([1]))  # a cache's rows cannot take places in itself
    narrower = StaticCache(capacity=12)
    narrower.start([torch.randn(1, heads, 5, head_dim)], [torch.randn(1, heads, 5, head_dim)], None, heads, head_dim)
    with pytest.raises(ValueError, match="widen both to the widest first"):
        running.place(torch.tensor([0]), narrower, torch.tensor([0]))


@pytest.mark.parametrize("running_length", [5, 0])
def test_rows_placed_with_their_bos_keep_it_last(running_length):
    """A refill whose bos ran ahead (the streams that join lengths start their sources in groups) brings that
    position, taken straight from any row of its group's cache: it ends at the running cache's length in the rows
    it takes, everything before it padding for them; a running cache holding no position yet moves right by one,
    the new first position padding for its own rows."""
    heads, head_dim = 2, 4
    running = StaticCache(capacity=8, zeroed=True)
    running.start([torch.randn(3, heads, 5, head_dim)], [torch.randn(3, heads, 5, head_dim)], None, heads, head_dim)
    for buffer in running.self_keys + running.self_values:
        buffer[:, :, :running_length] = torch.randn(3, heads, running_length, head_dim)
    running.length = running_length
    before = running.self_values[0][[0, 2], :, :running_length].clone()
    group = StaticCache(capacity=8)  # three sources started ahead: their bos at position 0
    group.start([torch.randn(3, heads, 5, head_dim)], [torch.randn(3, heads, 5, head_dim)], None, heads, head_dim)
    for buffer in group.self_keys + group.self_values:
        buffer[:, :, :1] = torch.randn(3, heads, 1, head_dim)
    group.length = 1

    running.place(torch.tensor([1]), group, torch.tensor([2]))  # the group's third row, straight from the group

    length = max(running_length, 1)
    assert running.length == length
    assert torch.equal(running.self_keys[0][1, :, length - 1], group.self_keys[0][2, :, 0])
    assert torch.equal(running.self_values[0][1, :, length - 1], group.self_values[0][2, :, 0])
    assert torch.equal(running.cross_keys[0][1], group.cross_keys[0][2])
    assert running.self_padding[1, :length].tolist() == [True] * (length - 1) + [False]
    assert (running.self_keys[0][1, :, : length - 1] == 0).all()  # zeroed: the released positions
    shift = length - running_length  # the running rows' positions, moved right where the cache held none
    assert torch.equal(running.self_values[0][[0, 2], :, shift:length], before)
    assert running.self_padding[[0, 2], :length].tolist() == [[True] * shift + [False] * running_length] * 2


def test_released_rows_stop_holding_positions():
    """A finished row waiting for a refill releases its positions: once the only other row that attended the
    first ones left too, they are dropped."""
    heads, head_dim = 2, 4
    cache = StaticCache(capacity=40)
    cache.start([torch.zeros(2, heads, 5, head_dim)], [torch.zeros(2, heads, 5, head_dim)], None, heads, head_dim)
    cache.length = 20
    cache.self_padding = torch.zeros(2, 40, dtype=torch.bool)
    cache.self_padding[1, :18] = True  # row 1 joined at position 18
    cache.release(torch.tensor([0]))
    assert cache.self_padding[0, :20].all() and not cache.self_padding[0, 20:].any()
    cache.drop_leading_padding()
    assert cache.length == 2 and cache.self_padding[:, :2].tolist() == [[True, True], [False, False]]


def test_shrunk_room_keeps_the_written_positions():
    """Buffers left longer than the rows need (their first positions dropped) are cut back to the room asked for,
    never below the written positions; keys, values and padding of the written positions stay."""
    heads, head_dim = 2, 4
    cache = StaticCache(capacity=40)
    cache.start([torch.zeros(3, heads, 5, head_dim)], [torch.zeros(3, heads, 5, head_dim)], None, heads, head_dim)
    cache.length = 6
    cache.self_keys[0][:, :, :6] = torch.randn(3, heads, 6, head_dim)
    cache.self_values[0][:, :, :6] = torch.randn(3, heads, 6, head_dim)
    keys, values = cache.self_keys[0][:, :, :6].clone(), cache.self_values[0][:, :, :6].clone()
    cache.release(torch.tensor([1]))
    cache.shrink_room(8)
    assert cache.capacity == 8 and cache.self_keys[0].shape == (3, heads, 8, head_dim)
    assert cache.self_padding.shape == (3, 8) and cache.self_padding[1, :6].all() and not cache.self_padding[0].any()
    assert torch.equal(cache.self_keys[0][:, :, :6], keys) and torch.equal(cache.self_values[0][:, :, :6], values)
    cache.shrink_room(2)  # below the written positions: only down to them
    assert cache.capacity == 6 and torch.equal(cache.self_keys[0], keys)
    assert cache.attended().tolist() == [[True] * 6, [False] * 6, [True] * 6]


def test_every_engine_is_a_runner_and_only_the_step_engines_place_rows(toy):
    """The runner types decoders ask about: every engine offers the whole :class:`Runner`; only the step engines'
    caches take a refill's rows in finished rows' places (the compiled runner is built, not compiled)."""
    runners = {engine: make_runner(engine, toy.models[0], 1.0, None) for engine in ("fairseq", "static", "compiled")}
    assert all(isinstance(runner, Runner) for runner in runners.values())
    assert {engine for engine, runner in runners.items() if isinstance(runner, PlacesRows)} == {"static", "compiled"}
    assert runners["fairseq"].max_target_positions == toy.models[0].decoder.max_positions()
    assert not runners["static"].identity_first_head  # a plain transformer: no k-head layer
