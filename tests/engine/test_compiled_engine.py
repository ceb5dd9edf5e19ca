"""--step-engine compiled (engine/compiled.py): fairseq's tokens, scores within 1e-4, few compilations;
fallbacks of both engines with their one-line reason."""

import importlib
import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fairseq_fastgen.engine import compiled
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.sequence_generators.runner import ModelRunner
from tests.engine.test_static_engine import CASES, SENTENCES, decode

onednn_linear_module = importlib.import_module("fairseq_fastgen.ops.onednn_linear")  # ops/ re-exports its function under that name
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)


def assert_same_tokens_close_scores(expected, actual, tolerance=1e-4):
    assert expected.keys() == actual.keys()
    for sentence, hypotheses in expected.items():
        assert len(actual[sentence]) == len(hypotheses), sentence
        for want, got in zip(hypotheses, actual[sentence]):
            assert torch.equal(got["tokens"], want["tokens"]), sentence
            assert abs(float(got["score"]) - float(want["score"])) <= tolerance, sentence
            assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=tolerance, rtol=0), sentence


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_engine_gives_fairseqs_tokens(toy, case):
    _, expected = decode(toy, SENTENCES, 7, step_engine="fairseq", **CASES[case])
    generator, actual = decode(toy, SENTENCES, 7, step_engine="compiled", **CASES[case])
    assert type(generator.runner) is CompiledRunner
    assert_same_tokens_close_scores(expected, actual)


def test_rows_above_the_row_buckets_share_one_compiled_step(toy, monkeypatch):
    """Rows beyond COMPILED_MAX_ROWS run one compiled step whose row count, target and source widths are
    symbolic (on the CPU with oneDNN): the same tokens, scores within 1e-4, the eager step never runs and
    every row count above the limit is served by that one compilation; rows falling under it take the
    fixed-shape buckets."""
    monkeypatch.setattr(compiled, "COMPILED_MAX_ROWS", 4)
    _, expected = decode(toy, SENTENCES, 32, step_engine="fairseq", decoder="var-batch", beam=4)
    generator = toy.generator(step_engine="compiled", decoder="var-batch", beam=4)
    runner = generator.runner
    eager_rows = []
    fast_form = runner.fast_form
    monkeypatch.setattr(runner, "fast_form",
                        lambda tokens, *rest: eager_rows.append(tokens.size(0)) or fast_form(tokens, *rest))
    torch._dynamo.reset()
    counters.clear()
    from tests.engine.test_static_engine import translate_batches

    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, SENTENCES, 32))
    assert {rows for rows, _, _ in runner.compiled_shapes} <= {1, 2, 4}
    if onednn_linear_module.onednn_available():
        assert runner.many_rows_compiled and not eager_rows
        assert counters["stats"]["unique_graphs"] == len(runner.compiled_shapes) + 1
    else:
        assert eager_rows and min(eager_rows) > 4


def test_the_many_rows_step_follows_a_weight_change(toy):
    """The step above the row buckets holds the weights as constants: after an in-place update of a decoder
    weight it compiles again and gives the updated model's tokens."""
    ids = SENTENCES[:24]
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled")
    runner = generator.runner
    if not runner.many_rows_on_cpu:
        pytest.skip("the step above the row buckets is compiled on the CPU with oneDNN only")
    from tests.engine.test_static_engine import translate_batches

    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8))
    first_compiled = runner._many_rows_step
    assert first_compiled is not None and runner.many_rows_compiled
    weight = toy.models[0].decoder.layers[-1].fc2.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)  # another model: other tokens
        _, changed = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
        assert any(not torch.equal(changed[s][0]["tokens"], expected[s][0]["tokens"]) for s in ids)
        assert_same_tokens_close_scores(changed, translate_batches(toy, generator, ids, 8))
        assert runner._many_rows_step is not first_compiled  # compiled again, for the new weights
    finally:
        with torch.no_grad():
            weight.copy_(original)


@pytest.mark.parametrize(
    "options", [dict(decoder="var-batch", beam=5), dict(decoder="var-stream", beam=5, stream_capacity=16)]
)
def test_compilations_stay_at_the_buckets(toy, options):
    """A whole decode at batch 64 compiles once per (rows, positions, source) bucket, not per batch or step."""
    torch._dynamo.reset()
    counters.clear()
    generator, _ = decode(toy, list(range(200)), 64, step_engine="compiled", **options)
    shapes = generator.runner.compiled_shapes
    # the fixed-shape buckets, and one step for every row count above them (on the CPU with oneDNN)
    assert counters["stats"]["unique_graphs"] == len(shapes) + generator.runner.many_rows_compiled
    assert generator.runner.statistics()["compiled_buckets"] == counters["stats"]["unique_graphs"]
    row_buckets = {rows for rows, _, _ in shapes}
    assert row_buckets <= {1, 2, 4, 8, 16} and len({width for _, _, width in shapes}) <= 4
    assert len(shapes) < generator.counters.counts["model_calls"] / 10


def test_unsupported_decoder_falls_back_with_its_reason(toy, monkeypatch, caplog):
    monkeypatch.setattr(toy.models[0].decoder, "cross_self_attention", True)
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled")
    assert type(generator.runner) is ModelRunner
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["--step-engine compiled: --cross-self-attention is not supported; using --step-engine fairseq"]


def test_frozen_weights_follow_a_weight_change(toy):
    """--compiled-freezing folds the weights into the compiled step: it gives fairseq's tokens, and after an
    in-place update of a decoder weight it compiles again and gives the updated model's tokens."""
    ids = SENTENCES[:12]
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_freezing=True)
    runner = generator.runner
    assert type(runner) is CompiledRunner and runner.freezing
    _, expected = decode(toy, ids, 1, step_engine="fairseq", decoder="greedy", beam=1)
    from tests.engine.test_static_engine import translate_batches

    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 1))
    first_compiled = runner._compiled_step
    weight = toy.models[0].decoder.layers[-1].fc2.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)  # another model: other tokens
        _, changed = decode(toy, ids, 1, step_engine="fairseq", decoder="greedy", beam=1)
        assert any(not torch.equal(changed[s][0]["tokens"], expected[s][0]["tokens"]) for s in ids)
        assert_same_tokens_close_scores(changed, translate_batches(toy, generator, ids, 1))
        assert runner._compiled_step is not first_compiled  # compiled again, for the new weights
    finally:
        with torch.no_grad():
            weight.copy_(original)


@pytest.mark.parametrize("decoder,beam", [("greedy", 1), ("beam", 4)])
def test_freezing_without_the_compiled_engine_is_refused(toy, decoder, beam):
    refusal = "--compiled-freezing applies to --step-engine compiled; got --step-engine static"
    with pytest.raises(ValueError, match=refusal):
        toy.generator(decoder=decoder, beam=beam, step_engine="static", compiled_freezing=True)
