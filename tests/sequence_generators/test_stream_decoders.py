"""Streaming for every decoder: greedy-stream gives greedy's tokens and blockwise-stream
blockwise's, sentence by sentence, over many refills; the fifo selection and the row budget give
var-batch's outputs; fairseq-generate and fairseq-interactive answer every input once, in order."""

import re

import pytest
import torch

from fairseq_fastgen.engine.runner_types import PlacesRows
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.sequence_generators import streaming
from fairseq_fastgen.sequence_generators.state import DecodingState
from test_blockwise import SOURCE_LENGTH, decode, loaded  # noqa: F401  (loaded: the k-head fixture)
from test_streaming import (  # noqa: F401  (fixtures: toy, var_batch_results, edge_case_data)
    CAPACITY, AdmissionLog, edge_case_data, hypothesis_lines, run_cli, translate_in_batches, var_batch_results,
)
from test_var_beam import TEST_SENTENCES, assert_identical, toy  # noqa: F401

LENGTH_LIMITS = {
    "source length": SOURCE_LENGTH,  # about half of the toy outputs are cut at this limit
    "one token": {"max_len_a": 0, "max_len_b": 1},  # every output: one token (then eos)
}


def assert_same_tokens_close_scores(expected, actual):
    """Sentence by sentence: the same tokens; scores within float rounding (the rows ran beside other
    companions, which changes the last bits of a product on this CPU)."""
    assert expected.keys() == actual.keys()
    for sentence, hypotheses in expected.items():
        want, got = hypotheses[0], actual[sentence][0]
        assert torch.equal(got["tokens"], want["tokens"]), sentence
        assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-5, rtol=0), sentence
        assert abs(float(got["score"]) - float(want["score"])) <= 1e-5, sentence


# ---- greedy-stream ------------------------------------------------------------------------------
GREEDY_STREAM_FORMS = {  # greedy-stream's two forms: its default on a step engine, and --stream-cohorts
    "joined": {},
    "cohorts": {"stream_cohorts": True},
}


@pytest.mark.parametrize("form", GREEDY_STREAM_FORMS.values(), ids=GREEDY_STREAM_FORMS.keys())
@pytest.mark.parametrize("limits", LENGTH_LIMITS.values(), ids=LENGTH_LIMITS.keys())
@pytest.mark.parametrize("eps", [1 / 12, 1 / 6, 1 / 2])
def test_greedy_stream_gives_greedys_tokens_over_many_refills(toy, eps, limits, form):
    ids = list(range(TEST_SENTENCES))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **limits), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=eps, **form, **limits)
    streamed = toy.translate(generator, ids)

    assert_same_tokens_close_scores(greedy, streamed)
    if form:  # cohorts: bitwise a static batch's scores where this CPU is companion-free
        static = toy.translate(toy.generator(decoder="greedy-stream", **form, **limits), ids)  # one batch
        assert_identical(static, streamed, across_batches=True)
    assert generator.counters.counts["refills"] >= TEST_SENTENCES / CAPACITY - 1
    sample = toy.sample(ids)
    source_width = sample["net_input"]["src_lengths"]  # its eos included, as fairseq's src_tokens.size(1)
    limit = dict(zip(sample["id"].tolist(), (source_width * limits["max_len_a"] + limits["max_len_b"]).tolist()))
    cut = [s for s in ids if streamed[s][0]["tokens"].numel() == limit[s] + 1]  # the limit's tokens and eos
    assert len(cut) >= 20  # sentences cut at the length limit are among them


@pytest.mark.parametrize("form", GREEDY_STREAM_FORMS.values(), ids=GREEDY_STREAM_FORMS.keys())
@pytest.mark.parametrize("engine", ["static", "compiled"])
def test_greedy_stream_on_the_engine(toy, engine, form):
    ids = list(range(0, TEST_SENTENCES, 2))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **SOURCE_LENGTH), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=6, step_engine=engine, **form,
                              **SOURCE_LENGTH)
    streamed = toy.translate(generator, ids)
    if engine == "static":
        assert_same_tokens_close_scores(greedy, streamed)
    assert all(torch.equal(streamed[s][0]["tokens"], greedy[s][0]["tokens"]) for s in ids)
    assert generator.counters.counts["refills"] >= 10


@pytest.mark.parametrize("eps", [1 / 12, 1 / 2, 7 / 8])
def test_greedy_stream_joining_lengths_gives_greedys_tokens(toy, eps):
    """greedy-stream on a step engine: refills join the running rows at their own positions, one call for every
    row, fewer calls than its cohorts make."""
    ids = list(range(TEST_SENTENCES))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **SOURCE_LENGTH), ids, 25)
    cohorts = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=eps, stream_cohorts=True,
                            **SOURCE_LENGTH)
    toy.translate(cohorts, ids)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=eps, **SOURCE_LENGTH)
    streamed = toy.translate(generator, ids)

    assert_same_tokens_close_scores(greedy, streamed)
    counts = generator.counters.counts
    assert counts["refills"] >= TEST_SENTENCES / CAPACITY - 1
    calls, cohort_calls = counts["model_calls"], cohorts.counters.counts["model_calls"]
    assert calls < cohort_calls if eps >= 1 / 2 else calls <= cohort_calls  # no refill catches up alone


def test_greedy_stream_form_misuse_is_refused(toy):
    """--stream-join-lengths without a step engine, with --stream-cohorts, or --stream-selection fifo without
    cohorts: a one-line error each."""
    with pytest.raises(Exception, match="--stream-join-lengths runs rows at different lengths in one call"):
        toy.generator(decoder="greedy-stream", stream_capacity=4, stream_join_lengths=True, step_engine="fairseq")
    with pytest.raises(Exception, match="--stream-join-lengths and --stream-cohorts are the two forms of greedy-"):
        toy.generator(decoder="greedy-stream", stream_capacity=4, stream_join_lengths=True, stream_cohorts=True)
    with pytest.raises(Exception, match="--stream-selection fifo orders greedy-stream's cohorts: add --stream-coh"):
        toy.generator(decoder="greedy-stream", stream_capacity=4, stream_selection="fifo")
    toy.generator(decoder="greedy-stream", stream_capacity=4, stream_selection="fifo", stream_cohorts=True)


@pytest.mark.parametrize("step_engine, unsupported, joins", [
    ("static", False, True), ("compiled", False, True),
    ("fairseq", False, False),  # fairseq's incremental decoder cannot run rows at different lengths in one call
    ("static", True, False),  # a model the engine does not serve runs on fairseq's decoder (one warning line)
])
def test_greedy_stream_joins_lengths_wherever_a_step_engine_runs_the_model(toy, monkeypatch, step_engine,
                                                                           unsupported, joins):
    """greedy-stream's form: refills in finished rows' places on a step engine, cohorts of equal length on
    fairseq's decoder (a model the engine does not serve included), never an error there; greedy's tokens."""
    from fairseq_fastgen.engine import choice
    from fairseq_fastgen.sequence_generators.greedy import JoinedGreedyPolicy

    if unsupported:  # what the engine's choice asks of the model
        monkeypatch.setattr(choice, "unsupported_reason", lambda decoder: "a decoder this test refuses")
    ids = list(range(0, TEST_SENTENCES, 4))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **SOURCE_LENGTH), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, step_engine=step_engine,
                              **SOURCE_LENGTH)
    streamed = toy.translate(generator, ids)

    assert isinstance(generator.policy, JoinedGreedyPolicy) == joins
    assert isinstance(generator.runner, PlacesRows) == joins
    assert all(torch.equal(streamed[s][0]["tokens"], greedy[s][0]["tokens"]) for s in ids)


# ---- blockwise-stream ---------------------------------------------------------------------------
class PositionLog:
    """The first target position of every row in each step_block call of a runner."""

    def __init__(self, runner, monkeypatch):
        self.calls = []
        step_block = runner.step_block

        def logged(tokens, positions, encoder_out, cache):
            self.calls.append(positions[:, 0].tolist())
            return step_block(tokens, positions, encoder_out, cache)

        monkeypatch.setattr(runner, "step_block", logged)

    def joined_calls(self):
        """Calls that ran the bos or the first block of some rows beside rows further on: rows that entered
        the batch at different times (in a static batch every row runs them in the same calls)."""
        return [c for c in self.calls if min(c) <= 1 < max(c)]

    def shared_first_positions(self):
        """Calls that ran the bos position of some rows beside rows further on."""
        return [c for c in self.calls if min(c) == 0 < max(c)]

    def bos_calls(self):
        """Calls that ran only bos positions: their row counts."""
        return [len(c) for c in self.calls if max(c) == 0]


def stream_blockwise(model, task, monkeypatch, **options):
    """blockwise-stream over the test set in one pool at CAPACITY: the generator, its PositionLog and
    {sentence id: (tokens, positional scores)}."""
    from fairseq.dataclass.configs import GenerationConfig

    generator = task.build_generator([model], GenerationConfig(beam=1, decoder="blockwise-stream",
                                                               stream_capacity=CAPACITY, **options, **SOURCE_LENGTH))
    log = PositionLog(generator.runner, monkeypatch)
    sample = task.dataset("test").collater([task.dataset("test")[i] for i in range(TEST_SENTENCES)])
    results = generator.generate([model], sample)
    streamed = {s: (h[0]["tokens"].tolist(), h[0]["positional_scores"]) for s, h in zip(sample["id"].tolist(), results)}
    return generator, log, streamed


def assert_blockwise_tokens(reference, streamed, tolerance):
    """Sentence by sentence: the reference's tokens, positional scores within ``tolerance``."""
    assert streamed.keys() == reference.keys()
    for sentence, (tokens, scores) in reference.items():
        assert streamed[sentence][0] == tokens, sentence
        assert torch.allclose(streamed[sentence][1], scores, atol=tolerance, rtol=0), sentence


@pytest.mark.parametrize("eps", [1 / 12, 1 / 6, 1 / 2])
@pytest.mark.parametrize("engine", ["fairseq", "static"])
def test_blockwise_stream_gives_blockwise_tokens_over_many_refills(loaded, engine, eps, monkeypatch):
    model, task = loaded(4)
    reference, _ = decode(model, task, 25, decoder="blockwise", step_engine=engine, **SOURCE_LENGTH)
    generator, log, streamed = stream_blockwise(model, task, monkeypatch, stream_eps=eps, step_engine=engine)
    assert_blockwise_tokens(reference, streamed, tolerance=1e-5)
    assert generator.counters.counts["refills"] >= TEST_SENTENCES / CAPACITY - 1
    if eps * CAPACITY >= 1:  # a refill comes while rows are running: they verify their blocks beside new rows
        assert len(log.joined_calls()) >= 5
    else:  # a refill only once every row has finished
        assert log.joined_calls() == []
    # every source's bos ran once, ahead, in its group's call: ENCODED_AHEAD capacities of sources a call
    assert log.shared_first_positions() == []
    group = streaming.ENCODED_AHEAD * CAPACITY
    assert sorted(log.bos_calls(), reverse=True) == [group] * (TEST_SENTENCES // group) + (
        [TEST_SENTENCES % group] if TEST_SENTENCES % group else [])


def test_joined_caches_keep_each_rows_positions():
    """StaticCache.concat of caches at different lengths: each row's written positions end at the longest
    length, in order, and everything left of them is padding."""
    def cache(rows, length, offset):
        c = StaticCache(8)
        keys = [torch.zeros(rows, 1, 3, 2)]
        c.start(keys, keys, None, heads=1, head_dim=2)
        c.length = length
        for buffer in c.self_keys + c.self_values:
            buffer[:, 0, :length, 0] = offset + torch.arange(length, dtype=torch.float)
        return c

    merged = StaticCache.concat([cache(2, 5, 100), cache(1, 2, 200)])
    assert merged.length == 5
    assert merged.self_keys[0][:2, 0, :5, 0].tolist() == [[100, 101, 102, 103, 104]] * 2
    assert merged.self_keys[0][2, 0, 3:5, 0].tolist() == [200, 201]
    assert merged.self_padding[:, :5].tolist() == [[False] * 5] * 2 + [[True, True, True, False, False]]


# ---- the streaming paper's other schedulers -----------------------------------------------------
@pytest.fixture(scope="module")
def var_batch_expansions(toy):
    generator = toy.generator(decoder="var-batch", beam=5)
    translate_in_batches(toy, generator, list(range(TEST_SENTENCES)), 25)
    return generator.counters.counts["candidate_expansions"]


@pytest.mark.parametrize("options", [
    {"stream_capacity": CAPACITY, "stream_selection": "fifo"},
    {"stream_capacity_rows": 24},
    {"stream_capacity_rows": 24, "stream_selection": "fifo", "stream_eps": 1 / 2},
], ids=["fifo", "row budget", "fifo row budget"])
def test_fifo_and_row_budget_give_var_batch_outputs(toy, var_batch_results, var_batch_expansions, options,
                                                    monkeypatch):
    log = AdmissionLog(monkeypatch)
    generator = toy.generator(decoder="var-stream", beam=5, **options)
    sample = toy.sample(range(TEST_SENTENCES))
    streamed = dict(zip(sample["id"].tolist(), generator.generate(toy.models, sample)))
    assert_identical(var_batch_results, streamed, across_batches=True)

    counts, per_step = generator.counters.counts, generator.counters.per_step["candidate_expansions"]
    assert counts["candidate_expansions"] == var_batch_expansions  # the same search, scheduled otherwise
    assert counts["iterations"] == len(per_step) and counts["refills"] >= 10
    source_len = sample["net_input"]["src_tokens"].ne(toy.task.source_dictionary.pad()).sum(1).tolist()
    _, (peak_sentences, _) = log.loads_at_refills(source_len)
    if "stream_capacity_rows" in options:  # pruned beams leave room: more sources than 24 rows // beam 5
        assert options["stream_capacity_rows"] // 5 < peak_sentences <= options["stream_capacity_rows"]
    else:
        assert peak_sentences == CAPACITY


def test_fifo_expands_the_earliest_cohort_first(toy):
    """With cohorts at two lengths, min-length expands the newer (shorter) one, fifo the older."""
    ids = list(range(60))
    schedules = {}
    for selection in ("min-length", "fifo"):
        generator = toy.generator(decoder="var-stream", beam=3, stream_capacity=6, stream_eps=0.5,
                                  stream_selection=selection)
        toy.translate(generator, ids)
        schedules[selection] = generator.counters.per_step["candidate_expansions"]
    assert sum(schedules["fifo"]) == sum(schedules["min-length"])
    assert schedules["fifo"] != schedules["min-length"]


@pytest.mark.parametrize("options, message", [
    ({"decoder": "blockwise-stream", "stream_selection": "fifo"},
     "--stream-selection fifo: --decoder blockwise-stream"),
    ({"decoder": "var-stream", "stream_capacity_rows": 0}, "--stream-capacity-rows must be an integer >= 1, got 0"),
])
def test_scheduler_misuse_is_refused(loaded, options, message):
    model, task = loaded(4)
    from fairseq.dataclass.configs import GenerationConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        task.build_generator([model], GenerationConfig(beam=1, **options))


def test_an_unknown_selection_is_refused():
    with pytest.raises(ValueError, match="--stream-selection must be one of min-length, fifo; got 'lifo'"):
        streaming.StreamingScheduler(capacity=4, selection="lifo")


# ---- command line -------------------------------------------------------------------------------
def test_fairseq_generate_and_interactive_greedy_stream(toy_model, plugin_dir, edge_case_data, monkeypatch):
    data, sources = edge_case_data
    args = [str(data), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu", "--dataset-impl",
            "raw", "--gen-subset", "test", "--beam", "1", "--batch-size", "4"]
    greedy = hypothesis_lines(run_cli("generate", args + ["--decoder", "greedy"], monkeypatch))
    streamed = hypothesis_lines(run_cli("generate", args + ["--decoder", "greedy-stream", "--stream-pool", "16"],
                                        monkeypatch))
    texts = lambda lines: {s: [line.split("\t")[2] for line in pair if line.startswith("H")]  # noqa: E731
                           for s, pair in lines.items()}
    assert sorted(streamed) == list(range(len(sources)))
    assert texts(streamed) == texts(greedy)

    interactive = run_cli("interactive", [str(toy_model.data_bin), "--path", str(toy_model.checkpoint),
                                          "--user-dir", plugin_dir, "--cpu", "--source-lang", "en",
                                          "--target-lang", "fr", "--beam", "1", "--decoder", "greedy-stream",
                                          "--buffer-size", "10", "--batch-size", "3"],
                          monkeypatch, stdin="\n".join(sources) + "\n")
    assert [int(m) for m in re.findall(r"^S-(\d+)\t", interactive, flags=re.M)] == list(range(len(sources)))
    assert texts(hypothesis_lines(interactive)) == texts(greedy)
    assert re.search(r"decoder greedy-stream: .*refills=\d+", interactive)


# ---- refills in the places of finished rows -------------------------------------------------------
class RowLog:
    """The row count of every step_block call of a runner, and the states streaming concatenated."""

    def __init__(self, runner, monkeypatch):
        self.rows, self.concatenated = [], []
        step_block = runner.step_block

        def logged(tokens, positions, encoder_out, cache):
            self.rows.append(tokens.size(0))
            return step_block(tokens, positions, encoder_out, cache)

        monkeypatch.setattr(runner, "step_block", logged)
        concat = DecodingState.concat

        def logged_concat(states):
            self.concatenated.append([s.rows for s in states])
            return concat(states)

        monkeypatch.setattr(DecodingState, "concat", staticmethod(logged_concat))


def test_greedy_refills_take_finished_rows_places(toy, monkeypatch):
    """--stream-join-lengths with refills at 7/8: a refill's rows take the places finished rows left (no copy
    of the running rows), every call runs the capacity's rows until no source waits and then a multiple of
    ROW_MULTIPLE, the sources are encoded ahead in groups and take their first step there, at their bos, in one
    call a group; greedy's tokens (no row set aside: test_rows_far_longer_than_the_others_are_set_aside)."""
    ids = list(range(TEST_SENTENCES))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **SOURCE_LENGTH), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=7 / 8,
                              stream_join_lengths=True, stream_set_aside=0, **SOURCE_LENGTH)  # every row in the stream
    log, positions = RowLog(generator.runner, monkeypatch), PositionLog(generator.runner, monkeypatch)
    streamed = toy.translate(generator, ids)

    assert_same_tokens_close_scores(greedy, streamed)
    assert log.concatenated == []  # every refill entered finished rows' places
    group = streaming.ENCODED_AHEAD * CAPACITY
    assert positions.shared_first_positions() == []  # no bos beside running rows
    assert positions.bos_calls() == [group] * (TEST_SENTENCES // group) + [TEST_SENTENCES % group]
    running = [rows for rows, first in zip(log.rows, positions.calls) if max(first) > 0]
    assert len(running) == len(log.rows) - len(positions.bos_calls())
    assert set(running) == {CAPACITY, streaming.ROW_MULTIPLE}
    assert running[: len(running) // 2] == [CAPACITY] * (len(running) // 2)
    counts = generator.counters.counts
    assert counts["refills"] >= TEST_SENTENCES // 2  # a refill at every step where rows finished
    assert counts["encoder_calls"] <= TEST_SENTENCES // (2 * CAPACITY)  # encoded ahead: 4 capacities a call
    assert counts["model_calls"] < 1.3 * sum(h[0]["tokens"].numel() for h in greedy.values()) / CAPACITY


ANSWERED_AT_START = {  # sources whose first token is eos (a limit of no token)
    "some": {"max_len_a": 0.15, "max_len_b": 0, "min_len": 0},  # sources of at most 6 tokens; others 1-5 tokens
    "every": {"max_len_a": 0, "max_len_b": 0, "min_len": 0},
}


@pytest.mark.parametrize("limits", ANSWERED_AT_START.values(), ids=ANSWERED_AT_START.keys())
def test_joined_rows_answered_at_their_first_step_take_no_place(toy, limits, monkeypatch):
    """A source whose first token is eos is answered in its group's first step and never takes a finished row's
    place: greedy's outputs, every sentence once, the running calls hold the capacity's rows until no source
    waits; where every source is answered so, no other call runs."""
    ids = list(range(TEST_SENTENCES))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **limits), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=7 / 8,
                              stream_join_lengths=True, **limits)
    log = PositionLog(generator.runner, monkeypatch)
    streamed = toy.translate(generator, ids)

    assert_same_tokens_close_scores(greedy, streamed)
    at_start = [s for s in ids if greedy[s][0]["tokens"].tolist() == [toy.task.target_dictionary.eos()]]
    assert 0 < len(at_start) < TEST_SENTENCES if limits["max_len_a"] else len(at_start) == TEST_SENTENCES
    assert generator.counters.counts["sentences"] == TEST_SENTENCES
    running = [len(first) for first in log.calls if max(first) > 0]
    assert len(running) + len(log.bos_calls()) == len(log.calls) == generator.counters.counts["model_calls"]
    if len(at_start) == TEST_SENTENCES:
        assert running == []
    else:
        assert running[: len(running) // 2] == [CAPACITY] * (len(running) // 2)


def test_compiled_engine_steps_joined_rows_in_its_compiled_unit(toy, monkeypatch):
    """--step-engine compiled: rows joined at different lengths (refills in finished rows' places) take the
    compiled padded step, each row at its own position and attending only its own positions, never the eager
    one; greedy's tokens, scores within 1e-4 (the compiled engine's promise)."""
    from fairseq_fastgen.engine import compiled
    from fairseq_fastgen.ops.onednn_linear import onednn_available

    if not onednn_available():
        pytest.skip("the step above the row buckets is compiled on the CPU with oneDNN only")
    ids = list(range(0, TEST_SENTENCES, 2))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", **SOURCE_LENGTH), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=7 / 8,
                              stream_join_lengths=True, step_engine="compiled", compiled_many_rows="unit",
                              **SOURCE_LENGTH)
    runner = generator.runner
    eager = RowLog(runner, monkeypatch)
    compiled_rows, unread_room, padded_step = [], [], runner.padded_step

    def logged(unit, last, positions, encoder_out, cache):
        compiled_rows.append(last.size(0))
        outputs = padded_step(unit, last, positions, encoder_out, cache)
        unread_room.append((last.size(0), cache.capacity, cache.length))  # the next step reads every position
        return outputs

    monkeypatch.setattr(runner, "padded_step", logged)
    streamed = toy.translate(generator, ids)

    for sentence in ids:
        want, got = greedy[sentence][0], streamed[sentence][0]
        assert torch.equal(got["tokens"], want["tokens"]), sentence
        assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-4, rtol=0), sentence
    assert eager.rows == [] and eager.concatenated == []
    group = streaming.ENCODED_AHEAD * CAPACITY  # a group of sources started ahead: their first step, at the bos
    assert set(compiled_rows) - set(range(1, CAPACITY)) == {CAPACITY, group}
    # once no source waits the finished rows go, none kept to round the count: the units pad rows to their
    # buckets themselves (kept_row_multiple 1), so the last calls run exactly the rows still decoding
    drained = compiled_rows[len(compiled_rows) - compiled_rows[::-1].index(CAPACITY):]
    assert drained == sorted(drained, reverse=True) and drained[-1] < streaming.ROW_MULTIPLE
    assert len(compiled_rows) == generator.counters.counts["model_calls"]
    # the buffers follow the rows' positions: the first ones, which no row attends any more, went (the step reads
    # every position of its buffers): above the row buckets a few positions of room, in a bucket's step the
    # smallest bucket capacity that holds the positions
    assert max(capacity - length for rows, capacity, length in unread_room if rows > runner.max_rows) \
        < 3 * compiled.POSITION_STEP
    bucket_steps = [(capacity, length) for rows, capacity, length in unread_room if rows <= runner.max_rows]
    assert bucket_steps and all(capacity == compiled.bucket_capacity(length) for capacity, length in bucket_steps)
    assert runner.many_rows_step is not None


@pytest.mark.parametrize("engine", ["static", "compiled"])
def test_blockwise_refills_take_finished_rows_places(loaded, engine, monkeypatch):
    model, task = loaded(4)
    reference, _ = decode(model, task, 25, decoder="blockwise", step_engine=engine, **SOURCE_LENGTH)
    from fairseq.dataclass.configs import GenerationConfig

    generator = task.build_generator([model], GenerationConfig(
        beam=1, decoder="blockwise-stream", stream_capacity=CAPACITY, stream_eps=7 / 8, step_engine=engine,
        **SOURCE_LENGTH))
    log = RowLog(generator.runner, monkeypatch)
    sample = task.dataset("test").collater([task.dataset("test")[i] for i in range(TEST_SENTENCES)])
    results = generator.generate([model], sample)
    streamed = {s: h[0]["tokens"].tolist() for s, h in zip(sample["id"].tolist(), results)}

    assert streamed == {s: tokens for s, (tokens, _) in reference.items()}
    assert log.concatenated == []
    group = streaming.ENCODED_AHEAD * CAPACITY  # the bos of a group of sources started ahead: one call
    assert log.rows.count(group) == TEST_SENTENCES // group
    verifying = [rows for rows in log.rows if rows != group]  # (and the last group's bos, fewer rows)
    assert max(verifying) == CAPACITY and verifying.count(CAPACITY) >= len(verifying) // 2
    assert generator.counters.counts["encoder_calls"] <= TEST_SENTENCES // (2 * CAPACITY)


REFILL_DEFAULTS = {  # a streaming decoder's options -> the --stream-eps its default acts as at CAPACITY, and another
    "greedy-stream": (dict(decoder="greedy-stream"), 7 / 8, 1 / 6),  # joined: a step engine runs the toy model
    "greedy-stream --stream-cohorts": (dict(decoder="greedy-stream", stream_cohorts=True), 1 / 6, 7 / 8),
    "var-stream": (dict(decoder="var-stream", beam=5), 1 / 6, 7 / 8),
}


def refills_and_calls(generator):
    counts = generator.counters.counts
    return counts["refills"], counts["model_calls"]


@pytest.mark.parametrize("options, acts_as, other", REFILL_DEFAULTS.values(), ids=REFILL_DEFAULTS.keys())
def test_default_refill_point_is_the_decoders_own(toy, options, acts_as, other):
    """Without --stream-eps a stream whose refills take finished rows' places refills as soon as a row finishes
    and a source fits (at CAPACITY what 7/8 does, a row below it); one whose refills start cohorts of their own
    at 1/6 of the capacity, the paper's.  The same outputs and the same refills and calls as that setting, other
    ones than the other setting's."""
    ids = list(range(0, TEST_SENTENCES, 2))
    runs = {}
    for eps in (None, acts_as, other):
        given = {} if eps is None else {"stream_eps": eps}
        generator = toy.generator(stream_capacity=CAPACITY, **options, **given, **SOURCE_LENGTH)
        runs[eps] = toy.translate(generator, ids), refills_and_calls(generator)
    assert_identical(runs[acts_as][0], runs[None][0], across_batches=True)
    assert runs[None][1] == runs[acts_as][1] != runs[other][1]


def test_blockwise_stream_refills_as_rows_finish_by_default(loaded, monkeypatch):
    """blockwise-stream's refills take finished rows' places: without --stream-eps it refills as soon as a row
    finishes (at CAPACITY the refills and calls of 7/8, more refills and fewer calls than at 1/6); blockwise's
    tokens."""
    model, task = loaded(4)
    reference, _ = decode(model, task, 25, decoder="blockwise", **SOURCE_LENGTH)
    runs = {}
    for eps in (None, 7 / 8, 1 / 6):
        generator, _, streamed = stream_blockwise(model, task, monkeypatch, **({} if eps is None else {"stream_eps": eps}))
        assert_blockwise_tokens(reference, streamed, tolerance=1e-5)
        runs[eps] = refills_and_calls(generator)
    assert runs[None] == runs[7 / 8]
    assert runs[None][0] > runs[1 / 6][0] and runs[None][1] < runs[1 / 6][1]


def test_blockwise_stream_verifies_joined_rows_in_compiled_block_units(loaded, monkeypatch):
    """--step-engine compiled --compiled-freezing: rows joined at different lengths verify their blocks (and a
    group of sources started ahead its bos positions, padded to a block) in the units compiled ahead of time for
    blocks, each row at its own positions; never the eager exact form.  blockwise's tokens, scores within 1e-4."""
    from fairseq_fastgen.engine.decoder_step import DecoderStep
    from fairseq_fastgen.ops.onednn_linear import onednn_available

    if not onednn_available():
        pytest.skip("blocks are compiled ahead of time on the CPU with oneDNN only")
    model, task = loaded(4)
    reference, _ = decode(model, task, 25, decoder="blockwise", step_engine="fairseq", **SOURCE_LENGTH)
    eager_calls, exact = [], DecoderStep.exact
    monkeypatch.setattr(DecoderStep, "exact", lambda *args, **kwargs: eager_calls.append(1) or exact(*args, **kwargs))
    _, log, streamed = stream_blockwise(model, task, monkeypatch, stream_eps=1 / 2, step_engine="compiled",
                                        compiled_freezing=True)
    assert_blockwise_tokens(reference, streamed, tolerance=1e-4)
    assert len(log.joined_calls()) >= 5 and log.shared_first_positions() == []  # the bos ran ahead
    assert eager_calls == [1]  # the first bos, before the runner knew the block's width


def test_answered_rows_keep_their_hypotheses_when_their_places_are_taken(toy):
    """A finished row's place goes to another sentence: its hypothesis keeps its own score (unnormalized: the
    cumulative score itself) and attention, greedy's within float rounding, the attention on the source positions
    (left-padded in greedy's batches, first in the stream's rows)."""
    ids = list(range(0, TEST_SENTENCES, 2))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy", unnormalized=True, **SOURCE_LENGTH), ids, 25)
    generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=7 / 8,
                              stream_join_lengths=True, unnormalized=True, **SOURCE_LENGTH)
    streamed = toy.translate(generator, ids)

    for sentence in ids:
        want, got = greedy[sentence][0], streamed[sentence][0]
        assert torch.equal(got["tokens"], want["tokens"]), sentence
        assert float(got["score"]) == pytest.approx(float(want["score"]), rel=1e-6, abs=1e-5), sentence
    source_len = dict(zip(toy.sample(ids)["id"].tolist(), toy.sample(ids)["net_input"]["src_lengths"].tolist()))
    compared = 0
    for sentence in ids:
        want, got = greedy[sentence][0]["attention"], streamed[sentence][0]["attention"]
        if want.numel():
            n = source_len[sentence]  # (source positions with eos, length)
            assert torch.allclose(got[:n], want[-n:], atol=1e-5), sentence
            assert not got[n:].any(), sentence
            compared += 1
    assert compared == len(ids)


class AsideLog:
    """Every model call of joined rows (``step_rows``): whether the side state of rows set aside made it
    (``SetAside.advance``), its rows and the cached positions its rows read (the cache's length)."""

    def __init__(self, runner, monkeypatch):
        self.calls, self.in_aside = [], False  # calls: (aside, rows, cached positions)
        step_rows, advance = runner.step_rows, streaming.SetAside.advance

        def logged_step_rows(last_tokens, positions, encoder_out, cache):
            self.calls.append((self.in_aside, last_tokens.size(0), cache.length))
            return step_rows(last_tokens, positions, encoder_out, cache)

        def logged_advance(aside, policy):
            self.in_aside = True
            try:
                return advance(aside, policy)
            finally:
                self.in_aside = False

        monkeypatch.setattr(runner, "step_rows", logged_step_rows)
        monkeypatch.setattr(streaming.SetAside, "advance", logged_advance)

    def positions_read(self) -> int:
        """Row-positions of cached keys/values all calls read."""
        return sum(rows * length for _, rows, length in self.calls)

    def longest_stream_cache(self) -> int:
        return max(length for aside, _, length in self.calls if not aside)


@pytest.mark.parametrize("engine", ["static", "compiled"])
def test_rows_far_longer_than_the_others_are_set_aside(toy, engine, monkeypatch):
    """--stream-set-aside: a row that runs far longer than the stream's others (no length limit: some toy outputs
    run on) leaves the stream for a side state stepped beside it; greedy's tokens, and the stream's rows stop
    reading the positions only it holds: its cache stays shorter and every call together reads fewer cached
    positions than the same stream with every row in it."""
    ids = list(range(TEST_SENTENCES))
    greedy = translate_in_batches(toy, toy.generator(decoder="greedy"), ids, 25)
    logs, counts = {}, {}
    for set_aside in (0, 8):
        generator = toy.generator(decoder="greedy-stream", stream_capacity=CAPACITY, stream_eps=7 / 8,
                                  stream_set_aside=set_aside, step_engine=engine)
        logs[set_aside] = AsideLog(generator.runner, monkeypatch)
        streamed = toy.translate(generator, ids)
        for sentence in ids:
            assert torch.equal(streamed[sentence][0]["tokens"], greedy[sentence][0]["tokens"]), sentence
        counts[set_aside] = generator.counters.counts
        monkeypatch.undo()

    lengths = sorted(h[0]["tokens"].numel() for h in greedy.values())
    assert lengths[-1] > 3 * lengths[len(lengths) // 2] and lengths[-1] > 8  # some outputs run far longer
    assert "rows_set_aside" not in counts[0] and not any(aside for aside, _, _ in logs[0].calls)
    assert counts[8]["rows_set_aside"] >= 2 and counts[8]["set_aside_steps"] >= 10
    aside_calls = [rows for aside, rows, _ in logs[8].calls if aside]
    assert len(aside_calls) == counts[8]["set_aside_steps"] and max(aside_calls) < streaming.SET_ASIDE_MIN_ROWS
    assert logs[8].longest_stream_cache() < logs[0].longest_stream_cache()
    assert logs[8].positions_read() < 0.8 * logs[0].positions_read()
    assert counts[8]["sentences"] == TEST_SENTENCES


@pytest.mark.parametrize("engine", ["fairseq", "static"])
def test_blockwise_rows_set_aside_keep_blockwise_tokens(loaded, engine, monkeypatch):
    """blockwise-stream sets rows aside as greedy-stream does (on fairseq's decoder, which takes no row in place,
    the side state's rows are copied out as well): blockwise's tokens."""
    model, task = loaded(4)
    reference, _ = decode(model, task, 25, decoder="blockwise", step_engine=engine, **SOURCE_LENGTH)
    generator, _, streamed = stream_blockwise(model, task, monkeypatch, stream_eps=7 / 8, step_engine=engine,
                                              stream_set_aside=4)
    assert_blockwise_tokens(reference, streamed, tolerance=1e-5)
    counts = generator.counters.counts
    assert counts["rows_set_aside"] >= 2 and counts["set_aside_steps"] >= 5
