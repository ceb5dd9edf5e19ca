"""Stock fairseq beam search (--decoder beam) on the engine (engine/stock_search.py): fairseq's search over the
static step gives bitwise stock fairseq's hypotheses, over the compiled step (--step-engine compiled) its tokens;
the beams of a sentence share its encoder-decoder keys in the engine's cache; ensembles fall back with one line."""

import logging

import pytest
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from omegaconf import OmegaConf

from fairseq_fastgen.adapters.ensemble import restore_ensemble
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.engine.stock_search import EngineEnsemble, run_stock_search_on_engine
from fairseq_fastgen.fastseq import share_encoder_cache, shares_encoder_cache
from fairseq_fastgen.fastseq.shared_cache import encoder_attention_modules
from fairseq_fastgen.integration import restore_stock_generator
from tests.engine.test_compiled_engine import assert_same_tokens_close_scores
from tests.engine.test_static_engine import SENTENCES, assert_same_attention, decode, translate_batches
from tests.sequence_generators.test_var_beam import assert_identical, toy  # noqa: F401  (fixture)

STOCK_CASES = {
    "beam4": dict(beam=4),
    "beam1": dict(beam=1),
    "beam8-nbest3": dict(beam=8, nbest=3),
    "beam4-ngram2": dict(beam=4, no_repeat_ngram_size=2),
    "beam4-cut-at-max-len": dict(beam=4, max_len_a=0, max_len_b=4),
    "beam4-fairseqs-own-loop": dict(beam=4, no_lean_beam_loop=True),
}
# batch 1 runs the cheapest cases (a row's step has no arithmetic across rows)
CASES_AND_BATCHES = [(c, b) for c in STOCK_CASES for b in (1, 7, 64) if b > 1 or c in ("beam4", "beam4-cut-at-max-len")]


def stock_config(**options):
    from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class once imported

    return OmegaConf.structured(GenerationConfig(decoder="beam", **options))


def decode_on_static_engine(toy, ids, batch_size, prefix_size=0, **options):
    """``decode`` with stock beam search moved onto the static step by hand."""
    config = stock_config(step_engine="fairseq", **options)
    generator = toy.task.build_generator(toy.models, config)
    restore_ensemble(generator)  # fairseq's ensemble, which fairseq's runner replaced
    assert run_stock_search_on_engine(generator, toy.models, "static")
    return generator, translate_batches(toy, generator, ids, batch_size, prefix_size)


@pytest.mark.parametrize("case,batch_size", CASES_AND_BATCHES)
def test_stock_search_on_the_static_engine_is_bitwise_stock(toy, case, batch_size):
    ids = SENTENCES[:30] if batch_size == 1 else SENTENCES
    expected = fairseqs_ensemble(toy, ids, batch_size, **STOCK_CASES[case])  # asserts fairseq's ensemble ran
    engine, actual = decode_on_static_engine(toy, ids, batch_size, **STOCK_CASES[case])
    assert type(engine.model) is EngineEnsemble and type(engine.model.runner) is StaticRunner
    assert_identical(expected, actual)
    assert_same_attention(expected, actual)


def test_stock_search_with_prefix_tokens_on_the_static_engine(toy):
    """Prefix tokens take fairseq's own loop (the lean loop leaves them to it)."""
    _, expected = decode(toy, SENTENCES[:40], 8, prefix_size=1, decoder="beam", beam=4, step_engine="fairseq")
    _, actual = decode_on_static_engine(toy, SENTENCES[:40], 8, prefix_size=1, beam=4)
    assert_identical(expected, actual)


@pytest.mark.parametrize("case", ["beam4", "beam4-ngram2", "beam4-fairseqs-own-loop"])
def test_stock_search_on_the_compiled_engine_gives_stock_tokens(toy, case):
    _, expected = decode(toy, SENTENCES, 7, decoder="beam", step_engine="fairseq", **STOCK_CASES[case])
    engine, actual = decode(toy, SENTENCES, 7, decoder="beam", step_engine="compiled", **STOCK_CASES[case])
    assert type(engine.model) is EngineEnsemble and type(engine.model.runner) is CompiledRunner
    assert_same_tokens_close_scores(expected, actual)


def recorded_cache_shapes(runner) -> list:
    """A list that gets, at each of ``runner``'s steps from now on: the step's rows, the rows of its cache's
    encoder-decoder keys and the cache's beams."""
    shapes, step = [], runner.step

    def recording_step(tokens, encoder_out, cache):
        outputs = step(tokens, encoder_out, cache)
        shapes.append((tokens.size(0), cache.cross_keys[0].size(0), cache.beams))
        return outputs

    runner.step = recording_step
    return shapes


@pytest.mark.parametrize("beam,prefix_size", [(5, 0), (8, 0), (4, 1)])
def test_the_beams_of_a_sentence_share_its_encoder_keys_on_the_compiled_engine(toy, beam, prefix_size):
    """On the CPU with oneDNN, stock beam search on the compiled engine holds the encoder-decoder keys/values
    once per sentence (beams above the row buckets): every step's cache has one row of them per sentence,
    also after sentences finish and leave, and the step for many rows reads them shared; stock's tokens."""
    from fairseq_fastgen.ops.onednn_linear import onednn_available

    if not onednn_available():
        pytest.skip("the step for many rows is compiled on the CPU with oneDNN only")
    ids = SENTENCES[:40]
    _, expected = decode(toy, ids, 8, prefix_size, decoder="beam", beam=beam, step_engine="fairseq")
    generator = toy.generator(decoder="beam", beam=beam, step_engine="compiled", compiled_many_rows="unit")
    runner = generator.model.runner
    shapes = recorded_cache_shapes(runner)
    eager_steps = recorded_eager_steps(runner)
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8, prefix_size))
    assert shapes and all(sources * beam == rows and beams == beam for rows, sources, beams in shapes)
    assert len({rows for rows, _, _ in shapes}) > 2  # sentences finished and left
    assert runner.units.packaged[("beams", beam)] is runner.many_rows_step is not None
    # each batch's first step: one row per sentence (its beams hold the same bos), eager, on a cache of one row
    # per sentence; every later step the unit's, on all the beams
    assert eager_steps == [(8, 1, 0)] * (len(ids) // 8)


def recorded_eager_steps(runner) -> list:
    """A list that gets (rows, the cache's beams, its positions) at each of ``runner``'s eager steps from now on."""
    calls, eager_step = [], runner.eager_step

    def recording_eager_step(tokens, encoder_out, cache):
        calls.append((tokens.size(0), cache.beams, cache.length))
        return eager_step(tokens, encoder_out, cache)

    runner.eager_step = recording_eager_step
    return calls


@pytest.mark.parametrize("beam,prefix_size,shared", [(5, 0, True), (4, 1, True), (4, 0, False)])
def test_stock_search_on_the_static_setting_runs_on_the_engine_sharing_encoder_keys(toy, beam, prefix_size, shared):
    """The default engine serves --decoder beam: fairseq's search over the static step, whose cache holds the
    encoder-decoder keys/values once per sentence (also after sentences finish and leave), the fairseq
    setting's shared encoder cache switched off; stock's hypotheses bitwise.  --no-shared-encoder-cache: one
    copy per beam."""
    ids = SENTENCES[:40]
    options = dict(decoder="beam", beam=beam, no_shared_encoder_cache=not shared)
    _, expected = decode(toy, ids, 8, prefix_size, step_engine="fairseq", **options)
    generator = toy.generator(step_engine="static", **options)
    runner = generator.model.runner
    assert type(generator.model) is EngineEnsemble and type(runner) is StaticRunner
    assert not shares_encoder_cache(generator)
    shapes = recorded_cache_shapes(runner)
    actual = translate_batches(toy, generator, ids, 8, prefix_size)
    assert_identical(expected, actual)
    assert_same_attention(expected, actual)
    per_sentence = beam if shared else 1
    assert shapes and all(sources * per_sentence == rows and beams == per_sentence for rows, sources, beams in shapes)
    assert len({rows for rows, _, _ in shapes}) > 2  # sentences finished and left


def test_an_ensemble_keeps_fairseqs_step_with_one_line(toy, caplog):
    config = stock_config(beam=4, step_engine="compiled")
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        generator = toy.task.build_generator(toy.models * 2, config)
    assert type(generator.model) is not EngineEnsemble
    assert [r.getMessage() for r in caplog.records] == [
        "--step-engine compiled: an ensemble of 2 models runs on fairseq's step; using --step-engine fairseq"
    ]


def test_stock_beam5_on_the_compiled_engine_compiles_one_step(toy):
    """Beam 5 keeps at least 5 rows per step, above COMPILED_MAX_ROWS: a whole decode at batch 64 compiles
    no fixed-shape bucket with torch.compile and, on the CPU with oneDNN, runs one step for every row count,
    compiled ahead of time (else the eager step)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine, _ = decode(toy, list(range(200)), 64, decoder="beam", beam=5, step_engine="compiled",
                       compiled_many_rows="unit")
    runner = engine.model.runner
    assert type(runner) is CompiledRunner and runner.units.compiled_shapes == {} and runner.units._bucket_step is None
    assert counters["stats"]["unique_graphs"] == 0  # the step for many rows is compiled ahead of time
    assert (runner.many_rows_step is not None) == runner.many_rows_on_cpu


def fairseqs_ensemble(toy, ids, batch_size, prefix_size=0, **options):
    """{sentence id: hypotheses} of ``--decoder beam`` over fairseq's own ensemble and decoder calls, with the
    FastSeq changes (fastseq/: the shared encoder cache, n-gram banning, the lean loop) and no runner."""
    generator = toy.task.build_generator(toy.models, stock_config(step_engine="fairseq", **options))
    restore_ensemble(generator)
    if not options.get("no_shared_encoder_cache"):
        assert share_encoder_cache(generator) == (options.get("beam", 5) > 1)
    assert type(generator.model) is EnsembleModel
    hypotheses = translate_batches(toy, generator, ids, batch_size, prefix_size)
    restore_stock_generator(generator)  # the models' attention classes as fairseq made them
    return hypotheses


def untouched_fairseq(toy, ids, batch_size, **options):
    """{sentence id: hypotheses} of fairseq's SequenceGenerator with every change of the plugin undone."""
    generator = restore_stock_generator(toy.task.build_generator(toy.models, stock_config(**options)))
    assert type(generator) is SequenceGenerator and type(generator.model) is EnsembleModel
    return translate_batches(toy, generator, ids, batch_size)


def recorded_sentence_keys(runner) -> list:
    """A list that gets, at each of fairseq's runner's steps from now on: the step's rows, and the rows of
    every layer's cached encoder-decoder keys times the cache's beams."""
    shapes, step = [], runner.step

    def recording_step(tokens, encoder_out, cache):
        outputs = step(tokens, encoder_out, cache)
        beams = getattr(cache, "beams", 1)
        keys = [module._get_input_buffer(cache)["prev_key"].size(0) * beams
                for module in encoder_attention_modules(runner.model)]
        shapes.append((tokens.size(0), *keys))
        return outputs

    runner.step = recording_step
    return shapes


@pytest.mark.parametrize("case,batch_size", [("beam4", 7), ("beam4", 64), ("beam8-nbest3", 7), ("beam1", 7),
                                             ("beam4-ngram2", 7), ("beam4-cut-at-max-len", 7),
                                             ("beam4-fairseqs-own-loop", 7)])
def test_stock_search_on_fairseqs_engine_runs_over_its_runner_bitwise(toy, case, batch_size):
    """--step-engine fairseq serves --decoder beam over fairseq's runner (one seam: the search reaches the
    model through the runner): the beams of a sentence share its encoder-decoder keys in the runner's cache;
    hypotheses and attention bitwise those of fairseq's own ensemble with FastSeq's shared cache, and, where
    the plugin changes no search rule (n-gram banning: stock's bans nothing on the CPU), of untouched fairseq."""
    options = STOCK_CASES[case]
    expected = fairseqs_ensemble(toy, SENTENCES, batch_size, **options)
    generator = toy.generator(decoder="beam", step_engine="fairseq", **options)
    runner = generator.model.runner
    assert type(generator.model) is EngineEnsemble and type(runner) is ModelRunner
    assert not shares_encoder_cache(generator)
    shapes = recorded_sentence_keys(runner)
    attention_classes = [type(m) for m in encoder_attention_modules(toy.models[0])]
    actual = translate_batches(toy, generator, SENTENCES, batch_size)
    assert [type(m) for m in encoder_attention_modules(toy.models[0])] == attention_classes  # stock between calls
    assert_identical(expected, actual)
    assert_same_attention(expected, actual)
    assert shapes and all(len(set(shape)) == 1 for shape in shapes)  # one key row per sentence, times its beams
    beams = options["beam"]
    assert runner.beams == beams
    if beams > 1 and "max_len_b" not in options:
        assert len({rows for rows, *_ in shapes}) > 2  # sentences finished and left
    if "no_repeat_ngram_size" not in options:
        stock = untouched_fairseq(toy, SENTENCES, batch_size, **options)
        assert_identical(stock, actual)
        assert_same_attention(stock, actual)


@pytest.mark.parametrize("prefix_size,shared", [(1, True), (0, False)])
def test_stock_search_on_fairseqs_engine_with_prefix_tokens_or_copied_keys(toy, prefix_size, shared):
    """Prefix tokens (fairseq's own loop) and --no-shared-encoder-cache (each beam its copy of the keys) over
    fairseq's runner: fairseq's ensemble's hypotheses bitwise."""
    options = dict(beam=4, no_shared_encoder_cache=not shared)
    ids = SENTENCES[:40]
    expected = fairseqs_ensemble(toy, ids, 8, prefix_size, **options)
    generator = toy.generator(decoder="beam", step_engine="fairseq", **options)
    assert type(generator.model) is EngineEnsemble and generator.model.runner.beams == (4 if shared else 1)
    shapes = recorded_sentence_keys(generator.model.runner)
    actual = translate_batches(toy, generator, ids, 8, prefix_size)
    assert_identical(expected, actual)
    assert_same_attention(expected, actual)
    assert shapes and all(len(set(shape)) == 1 for shape in shapes)
