"""Every engine path the reference models take at base and big size, on toy models of the same
presets: ``transformer_wmt_en_de`` and ``transformer_vaswani_wmt_en_de_big`` with their 6 + 6 post-norm layers, 8 and
16 attention heads and shared embeddings, widths scaled down to 64 (tests/models/preset_toy.py).

Sentence by sentence on 28 sentences of the toy test split: greedy on fairseq's step is stock beam 1 (at a fixed
length limit, and at batch 1 at a limit relative to the source's length); greedy on ``static`` is bitwise greedy on
fairseq's step; blockwise exact mode on the k = 4 identity-first student gives its base model's greedy tokens on each engine,
at batch 1 and 7.

The compiled engine runs on the base preset only, blockwise at batch 1 (its block unit and its row buckets, scores
within 1e-4): compiling every unit of both presets took about 20 minutes of a 2-core CPU (greedy's 1-row bucket
alone, or its frozen unit, about 2 minutes on a fresh cache), and the big preset differs from the base one in its
head count alone, which the static engine's cases cover bitwise; stock beam 5 on it at batch 7 runs the static
engine's step above the row buckets (--compiled-many-rows static). The compiled engine's greedy units, frozen ones,
its step above the row buckets and stock beam 5 on it are exercised on the toy models (test_compiled_engine.py).
"""

import types

import pytest

from fairseq.sequence_generator import EnsembleModel
from fairseq_fastgen.adapters.ensemble import restore_ensemble
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from tests.engine.test_compiled_engine import assert_same_tokens_close_scores
from tests.engine.test_compiled_many_rows import assert_beams_start_once, record_static_steps
from tests.engine.test_static_engine import SENTENCES, decode, translate_batches
from tests.models.khead_toy import one_thread  # noqa: F401  (fixture)
from tests.models.preset_toy import BLOCK_SIZE, preset_toy  # noqa: F401  (fixture)
from tests.sequence_generators.test_blockwise import SOURCE_LENGTH
from tests.sequence_generators.test_var_beam import assert_identical, load_toy

pytestmark = [pytest.mark.xdist_group("preset_shapes"), pytest.mark.usefixtures("one_thread")]

IDS = SENTENCES[:28]  # 28 sentences of the toy test split: 4 batches of 7
RUNNERS = {"fairseq": ModelRunner, "static": StaticRunner, "compiled": CompiledRunner}


@pytest.fixture(scope="module")
def preset(preset_toy):
    """The preset's toy (``base``) and its student (``student``) loaded with the test split, and ``greedy``:
    {sentence: hypotheses} of greedy on fairseq's step at batch 7, decoded once."""
    base = load_toy(preset_toy)
    student = load_toy(types.SimpleNamespace(checkpoint=preset_toy.student, data_bin=preset_toy.data_bin))
    decoder = base.models[0].decoder
    assert (len(base.models[0].encoder.layers), len(decoder.layers)) == (6, 6)
    assert decoder.layers[0].self_attn.num_heads == preset_toy.heads and not decoder.layers[0].normalize_before
    assert base.models[0].encoder.embed_tokens is decoder.embed_tokens  # --share-all-embeddings
    assert student.models[0].decoder.heads.identity_first and student.models[0].decoder.heads.block_size == BLOCK_SIZE
    _, greedy = decode(base, IDS, 7, decoder="greedy", beam=1, step_engine="fairseq", **SOURCE_LENGTH)
    return types.SimpleNamespace(base=base, student=student, greedy=greedy, heads=preset_toy.heads)


COMPILED_PRESET_HEADS = 8  # the compiled engine's cases run on the base preset (the module's docstring says why)


def compiled_on_this_preset(preset, engine):
    if engine == "compiled" and preset.heads != COMPILED_PRESET_HEADS:
        pytest.skip("the compiled engine runs on the base preset only (CI time)")


FIXED_LENGTH = {"max_len_a": 0, "max_len_b": 16}  # a limit stock's search and the plugin's decoders agree on


def test_greedy_on_fairseqs_step_is_stock_beam_1(preset):
    _, greedy = decode(preset.base, IDS, 7, decoder="greedy", beam=1, step_engine="fairseq", **FIXED_LENGTH)
    stock = preset.base.generator(decoder="beam", beam=1, step_engine="fairseq", **FIXED_LENGTH)
    restore_ensemble(stock)  # fairseq's own ensemble and decoder calls, not fairseq's runner
    assert type(stock.model) is EnsembleModel
    expected = translate_batches(preset.base, stock, IDS, 7)
    assert_identical(expected, greedy, across_batches=True)
    # the toy's tokens differ from sentence to sentence (its base has had two updates: see preset_toy.py)
    assert len({tuple(hypotheses[0]["tokens"].tolist()) for hypotheses in expected.values()}) >= 5


def test_greedy_is_stock_beam_1_at_a_source_relative_limit(preset):
    """At batch 1, where stock's limit (from the batch's longest source) is a row's own."""
    _, expected = decode(preset.base, IDS, 1, decoder="beam", beam=1, step_engine="fairseq", **SOURCE_LENGTH)
    _, greedy = decode(preset.base, IDS, 1, decoder="greedy", beam=1, step_engine="fairseq", **SOURCE_LENGTH)
    assert_identical(expected, greedy)
    cut = [s for s in IDS if greedy[s][0]["tokens"].numel() == preset.base.dataset.src_sizes[s] + 1]  # limit and eos
    assert len(cut) >= 5  # the limit counts each source's eos, as stock's does


def test_greedy_on_the_static_engine_is_bitwise_greedy_on_fairseqs_step(preset):
    generator, actual = decode(preset.base, IDS, 7, decoder="greedy", beam=1, step_engine="static", **SOURCE_LENGTH)
    assert type(generator.runner) is StaticRunner
    assert_identical(preset.greedy, actual)


# the compiled engine's block unit at batch 1 (the module's docstring says why not at 7)
@pytest.mark.parametrize("engine,batch_size", [(engine, batch_size) for engine in RUNNERS for batch_size in (1, 7)
                                               if (engine, batch_size) != ("compiled", 7)])
def test_exact_blockwise_gives_the_bases_greedy_tokens(preset, engine, batch_size):
    """The student's head 1 is its frozen base's output: blockwise's tokens are greedy's on the base, and its
    positional scores within 1e-4 (the base's step and the student's verification are other products)."""
    compiled_on_this_preset(preset, engine)
    generator, actual = decode(preset.student, IDS, batch_size, decoder="blockwise", beam=1, step_engine=engine,
                               **SOURCE_LENGTH)
    assert type(generator.runner) is RUNNERS[engine]
    assert_same_tokens_close_scores(preset.greedy, actual)
    assert generator.counters.as_dict()["mean_accepted_block_size"] > 2  # blocks were accepted, not one token at a time


def test_stock_beam5_on_the_compiled_engine_runs_the_static_step_above_its_buckets(preset, monkeypatch):
    """--compiled-many-rows static (the default on processors without AVX-512): stock beam 5's rows, always above the
    row buckets, run the static engine's step on the compiled engine's cache, each sentence's encoder-decoder keys
    held once for its 5 beams; stock's tokens, scores within 1e-4, and no unit built for those rows."""
    compiled_on_this_preset(preset, "compiled")
    options = dict(decoder="beam", beam=5, **SOURCE_LENGTH)
    _, expected = decode(preset.base, IDS, 7, step_engine="fairseq", **options)
    generator = preset.base.generator(step_engine="compiled", compiled_many_rows="static", **options)
    runner = generator.model.runner
    calls = record_static_steps(runner, monkeypatch)
    assert_same_tokens_close_scores(expected, translate_batches(preset.base, generator, IDS, 7))
    assert calls and not any(stand_in for _, _, stand_in, _ in calls)
    assert_beams_start_once(calls, 7, 5)
    assert runner.many_rows_step is None
