"""--decoder blockwise on the engine: its verification pass (several positions per row) and its rollback run
through the runner's ``step_block`` / ``keep_accepted``, so the static engine serves it.

On the toy k-head checkpoints (k = 2 identity-first, k = 4 learned head 1), fp32 on the CPU, sentence by
sentence: ``static`` gives bitwise fairseq's hypotheses (tokens, positional scores, attention) and the same
statistics; ``compiled`` the same tokens, scores within 1e-4.
"""

import pytest
import torch

from fairseq.dataclass.configs import GenerationConfig
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.engine.static_cache import StaticCache
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from tests.models.khead_toy import khead_k2, khead_k4, one_thread  # noqa: F401  (fixtures)
from tests.sequence_generators.test_blockwise import SOURCE_LENGTH, loaded, run_generator  # noqa: F401  (fixture)

pytestmark = [pytest.mark.xdist_group("toy_khead"), pytest.mark.usefixtures("one_thread")]

RUNNERS = {"fairseq": ModelRunner, "static": StaticRunner, "compiled": CompiledRunner}


def blockwise(model, task, batch_size, engine, prefix_size=0, **options):
    """{sentence id: (tokens, positional scores, attention)} and the generator's statistics."""
    config = GenerationConfig(beam=1, decoder="blockwise", step_engine=engine, **SOURCE_LENGTH, **options)
    generator = task.build_generator([model], config)
    assert type(generator.runner) is RUNNERS[engine]
    outputs = run_generator(generator, model, task, batch_size, prefix_size, attention=True)
    assert len(outputs) == 200
    return outputs, generator.counters.as_dict()


def count_uneven_rollbacks(monkeypatch):
    """Count keep_accepted calls where rows keep different numbers of positions (the left-padding path)."""
    calls = []
    keep_accepted = StaticCache.keep_accepted

    def counting(cache, accepted):
        counts = accepted.sum(dim=1)
        calls.append(bool(counts.ne(counts[0]).any()))
        keep_accepted(cache, accepted)

    monkeypatch.setattr(StaticCache, "keep_accepted", counting)
    return calls


CASES = {
    "k2-exact-full": (2, dict(blockwise_full_proposals=True)),
    "k4-exact": (4, {}),
    "k4-top2": (4, dict(blockwise_top_k=2)),
    "k2-int8": (2, dict(blockwise_int8_proposals=True)),
    "k4-ngram2": (4, dict(no_repeat_ngram_size=2)),
}


@pytest.mark.parametrize("case,batch_size", [(c, b) for c in CASES for b in (1, 7, 64) if b == 7 or "exact" in c])
def test_blockwise_on_the_static_engine_is_bitwise_fairseq(loaded, monkeypatch, case, batch_size):
    block_size, options = CASES[case]
    model, task = loaded(block_size)
    expected, expected_stats = blockwise(model, task, batch_size, "fairseq", **options)
    uneven = count_uneven_rollbacks(monkeypatch)
    actual, stats = blockwise(model, task, batch_size, "static", **options)
    for sentence, (tokens, scores, attention) in expected.items():
        assert actual[sentence][0] == tokens, sentence
        assert torch.equal(actual[sentence][1], scores), sentence
        assert torch.equal(actual[sentence][2], attention), sentence
    assert stats == expected_stats  # the same blocks accepted, the same model calls
    if batch_size > 1:  # rows that kept different numbers of positions, left-padded in the static buffers
        assert sum(uneven) > 10


def test_blockwise_on_the_static_engine_with_a_prefix(loaded):
    model, task = loaded(4)
    expected, _ = blockwise(model, task, 7, "fairseq", prefix_size=2)
    actual, _ = blockwise(model, task, 7, "static", prefix_size=2)
    assert {s: o[0] for s, o in actual.items()} == {s: o[0] for s, o in expected.items()}
    assert all(torch.equal(actual[s][1], expected[s][1]) for s in expected)
    targets = {s: task.dataset("test")[s]["target"][:2].tolist() for s in expected}
    assert all(tokens[:2] == targets[s] for s, (tokens, _, _) in actual.items() if len(targets[s]) == 2)


@pytest.mark.parametrize("block_size,batch_size", [(4, 1), (4, 64), (2, 7)])
def test_blockwise_on_the_compiled_engine_gives_fairseqs_tokens(loaded, block_size, batch_size):
    model, task = loaded(block_size)
    expected, _ = blockwise(model, task, batch_size, "fairseq")
    actual, _ = blockwise(model, task, batch_size, "compiled")
    assert {s: o[0] for s, o in actual.items()} == {s: o[0] for s, o in expected.items()}
    assert all(torch.allclose(actual[s][1], expected[s][1], atol=1e-4) for s in expected)


def test_keep_accepted_left_pads_rows_as_fairseqs_rollback():
    """Two rows, three positions written, then three new ones of which row 0 keeps 1 and row 1 keeps 3:
    row 0's four positions move to the right end of the six, after two padding positions."""
    rows, heads, head_dim = 2, 1, 1
    cache = StaticCache(capacity=8)
    cache.start([torch.zeros(rows, heads, 2, head_dim)], [torch.zeros(rows, heads, 2, head_dim)], None, heads,
                head_dim)
    positions = torch.arange(6.0).view(1, 1, 6, 1).expand(rows, heads, 6, head_dim)
    cache.self_keys[0][:, :, :6] = positions
    cache.self_values[0][:, :, :6] = positions + 10
    cache.length = 6
    cache.keep_accepted(torch.tensor([[True, False, False], [True, True, True]]))
    assert cache.length == 6
    assert cache.self_keys[0][0, 0, :6, 0].tolist()[2:] == [0, 1, 2, 3]
    assert cache.self_keys[0][1, 0, :6, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert cache.self_values[0][0, 0, 2:6, 0].tolist() == [10, 11, 12, 13]
    assert cache.self_padding[:, :6].tolist() == [[True, True, False, False, False, False], [False] * 6]
    assert cache.attended_padding(2).tolist() == [[True, True] + [False] * 6, [False] * 8]
    cache.length = 8
    cache.keep_accepted(torch.tensor([[True, False], [True, False]]))  # the same count everywhere: the last drops
    assert cache.length == 7 and cache.self_padding[0, :2].tolist() == [True, True]


# (k = 4 with --compiled-freezing as well compiles a unit per row bucket more, minutes on a cold CI cache, for what
# the two cases below already cover between them: a block of 4 in compiled units, and frozen row buckets)
@pytest.mark.parametrize("block_size,freezing", [(4, False), (2, True)],
                         ids=["k4-compiled", "k2-identity-first-compiled-freezing"])
def test_blockwise_verifies_its_blocks_in_compiled_units(loaded, monkeypatch, block_size, freezing):
    """--step-engine compiled: every verification of k positions per row runs a unit compiled ahead of time
    (above the row buckets; with --compiled-freezing each row bucket's too, 3 rows padded to 4), never the
    eager exact form; with an identity head 1 (k = 2) the unit also gives head 1's log-probabilities (no
    projection of a block outside it), and a bos of a bucket's rows its own frozen unit of one position, scored
    with its features.  fairseq's tokens, scores within 1e-4."""
    from fairseq_fastgen.engine import aot_step, compiled
    from fairseq_fastgen.ops import int8_kernel
    from fairseq_fastgen.engine.decoder_step import DecoderStep

    model, task = loaded(block_size)
    probe = CompiledRunner(model)
    if not probe.many_rows_on_cpu:
        pytest.skip("blocks are compiled ahead of time on the CPU with oneDNN only")
    expected, _ = blockwise(model, task, 7, "fairseq")
    eager_blocks, exact = [], DecoderStep.exact

    def counting(step, tokens, *args, **kwargs):
        eager_blocks.append(tokens.size(1)) if tokens.size(1) > 1 else None
        return exact(step, tokens, *args, **kwargs)

    monkeypatch.setattr(DecoderStep, "exact", counting)
    block_rows, run_padded = [], CompiledRunner.run_padded

    def logged(runner, unit, tokens, positions, cache):
        if tokens.size(1) > 1:
            block_rows.append((tokens.size(0), cache.self_keys[0].size(0)))
        return run_padded(runner, unit, tokens, positions, cache)

    monkeypatch.setattr(CompiledRunner, "run_padded", logged)
    projected, project = [], CompiledRunner.project
    monkeypatch.setattr(CompiledRunner, "project", lambda runner, features, *args: projected.append(
        features.size(1)) or project(runner, features, *args))
    products, package = {}, aot_step.StepPackage.__init__  # (rows, positions) of each unit -> its products' kind

    def recording(self, step, table, rows=None):
        products[(rows, step.block, step.one_position_block)] = type(step.decoder_step.reduced).__name__
        package(self, step, table, rows)

    monkeypatch.setattr(aot_step.StepPackage, "__init__", recording)
    config = GenerationConfig(beam=1, decoder="blockwise", step_engine="compiled", compiled_freezing=freezing,
                              **SOURCE_LENGTH)
    generator = task.build_generator([model], config)
    actual = run_generator(generator, model, task, 7)
    assert {s: o[0] for s, o in actual.items()} == {s: o[0] for s, o in expected.items()}
    assert all(torch.allclose(actual[s][1], expected[s][1], atol=1e-4, rtol=0) for s in expected)

    runner = generator.runner
    units = {key[2] for key, step in runner.units.packaged.items()
             if isinstance(key, tuple) and key[:2] == ("block", block_size) and step is not None}
    max_rows = compiled.FROZEN_MAX_ROWS if freezing else compiled.COMPILED_MAX_ROWS
    if freezing:  # every block ran compiled: 7 rows down to 1, the cache's rows padded to the bucket
        assert eager_blocks == [] and units == {None, 1, 2, 4}
        assert {cache_rows for rows, cache_rows in block_rows if rows == 3} == {4}
        # the buckets' units (up to 8 rows of products: rows x positions) through the plugin's float32 kernel
        # where it runs, the unit for more rows through oneDNN's products
        kernel = "F32RowsWeights" if int8_kernel.f32_rows_available() else "NoneType"
        assert {key: kind for key, kind in products.items() if key[1] == block_size} == {
            (1, 2, False): kernel, (2, 2, False): kernel, (4, 2, False): kernel, (None, 2, False): "NoneType"}
        # the bos of the last batch (4 rows, a bucket; and the last token of rows at their length limit): a unit of
        # one position scored as a block, through the kernel
        one_position = {key[0]: kind for key, kind in products.items() if key[1] == 1}
        assert 4 in one_position and set(one_position.values()) == {kernel}
        assert all(key[2] for key in products if key[1] == 1) and runner.units.packaged[("block", 1, 4)] is not None
    else:  # the row buckets' blocks run eager, the others compiled; a bos, eager
        assert eager_blocks and units == {None}
        assert all(key[1] > 1 for key in products)
        assert all(rows > max_rows for rows, _ in block_rows)
    assert {rows for rows, _ in block_rows} >= set(range(max_rows + 1, 8)) - {5, 6} | {7}
    identity_first = model.decoder.heads.identity_first
    assert runner.scores_blocks == identity_first
    if identity_first and freezing:  # only the later heads' proposals, one position each, projected eager
        assert projected and set(projected) == {1}
