"""--step-engine compiled (engine/compiled.py): fairseq's tokens, scores within 1e-4, few compilations;
fallbacks of both engines with their one-line reason."""

import importlib
import logging
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fairseq_fastgen.engine import compiled
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.engine.static_cache import StaticCache
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
    """Rows beyond COMPILED_MAX_ROWS run one step compiled ahead of time whose row count, target and source
    widths are symbolic (on the CPU with oneDNN): the same tokens, scores within 1e-4, the eager step never
    runs and no row count above the limit compiles anything more; rows falling under it take the fixed-shape
    buckets."""
    monkeypatch.setattr(compiled, "COMPILED_MAX_ROWS", 4)
    _, expected = decode(toy, SENTENCES, 32, step_engine="fairseq", decoder="var-batch", beam=4)
    generator = toy.generator(step_engine="compiled", compiled_many_rows="unit", decoder="var-batch", beam=4)
    runner = generator.runner
    eager_rows = []
    fast_form = runner.fast_form
    monkeypatch.setattr(runner, "fast_form",
                        lambda tokens, *rest: eager_rows.append(tokens.size(0)) or fast_form(tokens, *rest))
    torch._dynamo.reset()
    counters.clear()
    from tests.engine.test_static_engine import translate_batches

    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, SENTENCES, 32))
    assert {rows for rows, _, _ in runner.units.compiled_shapes} <= {1, 2, 4}
    # the step above them is not dynamo's
    assert counters["stats"]["unique_graphs"] == len(runner.units.compiled_shapes)
    if onednn_linear_module.onednn_available():
        assert runner.many_rows_step is not None and not eager_rows
    else:
        assert eager_rows and min(eager_rows) > 4


def test_the_many_rows_step_is_compiled_once_and_loaded_by_later_runners(toy, tmp_path, monkeypatch, caplog):
    """The step above the row buckets is written to $FASTGEN_COMPILED_DIR by the first runner that needs it;
    a later runner of the same model (another process, a later run) loads it instead of compiling, and both
    give fairseq's tokens.  A stale temporary file of a killed compilation changes nothing.  The unit's frozen
    weights, constants inside its library copied out at load, then leave the library's pages: once loaded, those
    pages are no longer in the process's memory (without the release they all are), and the unit still gives
    fairseq's tokens.  The token embeddings are none of its constants (an input: the model's own table).  No
    load leaves torch's extracted copy of the package behind in $TMPDIR."""
    if not onednn_linear_module.onednn_available():
        pytest.skip("the step above the row buckets is compiled on the CPU with oneDNN only")
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    extracted = tmp_path / "tmpdir"
    extracted.mkdir()
    monkeypatch.setenv("TMPDIR", str(extracted))
    (tmp_path / ".step-0.123.tmp.pt2").write_bytes(b"half a package")
    from tests.engine.test_static_engine import translate_batches

    ids = SENTENCES[:24]
    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    outcomes = []
    for _ in range(2):
        generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_many_rows="unit")
        with caplog.at_level(logging.INFO, logger="fairseq_fastgen.engine"):
            assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8))
        outcomes.append(None in generator.runner.units.compiled_now)
    assert outcomes == [True, False]
    assert len(list(tmp_path.glob("step-any-rows-*.pt2"))) == 1
    lines = [r.getMessage() for r in caplog.records if "the step above" in r.getMessage()]
    assert len(lines) == 2 and "compiled and stored in" in lines[0] and " loaded in " in lines[1]
    assert not list(extracted.iterdir())

    from fairseq_fastgen.engine import loaded_package

    (package,) = tmp_path.glob("step-any-rows-*.pt2")
    for release in (False, True):
        with monkeypatch.context() as patches:
            if not release:
                patches.setattr(loaded_package, "release_constant_pages", lambda library: 0)
            before = loaded_package.mapped_libraries()
            unit = loaded_package.load_package(package)
            (library,) = [path for path in loaded_package.mapped_libraries() - before if "wrapper" in path]
        assert str(extracted) in library and not list(extracted.iterdir())  # extracted there, then removed
        size, resident = resident_constants(library)
        assert size > 64 * 4096  # the toy's weights: enough pages to tell
        assert (resident < size / 8) if release else (resident >= size)
    # the token embeddings are an input, not a constant of the unit: the model's own table, not a copy
    assert not [name for name in unit.constant_names() if "embed_tokens" in name or "output_projection" in name]
    generator.runner.units.packaged[None] = unit  # the released unit serves the decode
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8))


def test_the_unit_of_many_rows_runs_its_loops_on_the_threads_of_the_process_it_is_made_for(toy, tmp_path,
                                                                                            monkeypatch):
    """The loops between a unit's products are written for the threads of the process that describes the unit: for
    one thread serial, for more OpenMP's parallel loops whose thread count is read when they run, in a unit keyed
    apart (a background compilation runs one thread, which must not make the unit of a two-thread decode serial).
    Both give fairseq's tokens."""
    if not onednn_linear_module.onednn_available():
        pytest.skip("the step above the row buckets is compiled on the CPU with oneDNN only")
    import zipfile

    from tests.engine.test_static_engine import translate_batches

    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    ids = SENTENCES[:24]
    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_many_rows="unit")
            assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8))
    finally:
        torch.set_num_threads(threads_before)

    def parallel_loops(package: Path) -> bool:
        with zipfile.ZipFile(package) as archive:
            return any("#pragma omp parallel" in archive.read(name).decode("utf-8", "replace")
                       for name in archive.namelist() if name.endswith(".cpp"))

    assert sorted(parallel_loops(package) for package in tmp_path.glob("step-any-rows-*.pt2")) == [False, True]


def resident_constants(library: str) -> tuple:
    """(bytes of ``library``'s constants, bytes of the mappings that hold them now in this process's memory)."""
    import re

    from fairseq_fastgen.engine.loaded_package import constants_range

    start, end = constants_range(library)
    resident, overlaps = 0, False
    for line in open("/proc/self/smaps"):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            overlaps = int(span.group(1), 16) < end and int(span.group(2), 16) > start
        elif overlaps and line.startswith("Rss:"):
            resident += int(line.split()[1]) * 1024
    return end - start, resident


BACKGROUND_CASES = {
    "many rows": dict(batch=8, freezing=False, key=None, what="the step above 2 rows"),
    "frozen row bucket": dict(batch=1, freezing=True, key=1, what="the step of 1 rows"),
}


@pytest.mark.parametrize("case", BACKGROUND_CASES.values(), ids=BACKGROUND_CASES.keys())
def test_compiled_steps_compile_in_the_background_while_the_decode_runs_eager(toy, tmp_path, monkeypatch, caplog,
                                                                             case):
    """--compile-in-background: a decode that finds a step compiled ahead of time missing on disk hands its
    compilation to a child process and runs those steps eager (fairseq's tokens; no torch.compile in its place)
    without waiting; once the child has stored the package the runner switches to it (the same tokens again), and
    a later runner loads it."""
    if not onednn_linear_module.onednn_available():
        pytest.skip("the steps compiled ahead of time are compiled on the CPU with oneDNN only")
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    from tests.engine.test_static_engine import translate_batches

    ids, batch, key = SENTENCES[:16], case["batch"], case["key"]
    _, expected = decode(toy, ids, batch, step_engine="fairseq", decoder="greedy", beam=1)
    options = dict(decoder="greedy", beam=1, step_engine="compiled", compile_in_background=True,
                   compiled_freezing=case["freezing"], compiled_many_rows="unit")
    generator = toy.generator(**options)
    runner = generator.runner
    units = runner.units
    uncompiled = []
    for owner, name in [(runner, "fast_form"), (units, "eager_padded")]:  # the eager forms: above the row
        form = getattr(owner, name)  # buckets, and of a bucket
        monkeypatch.setattr(owner, name, lambda *inputs, form=form: uncompiled.append(1) or form(*inputs))
    with caplog.at_level(logging.INFO, logger="fairseq_fastgen.engine"):
        assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, batch))
    assert units.background is not None and units.background[0] == key and uncompiled
    if case["freezing"]:
        assert units.compiled_shapes == {}  # no torch.compile bucket stood in for the unit
    compilation = units.background[2]
    lines = [r.getMessage() for r in caplog.records if "in the background" in r.getMessage()]
    assert lines == [f"--step-engine compiled: {case['what']} is compiled in the background (process "
                     f"{compilation.pid}, which stores it in {tmp_path} even if this decode ends first); those "
                     f"steps run eager until it is ready"]
    deadline = time.monotonic() + 600
    while key not in units.packaged:  # what the decode's steps poll: the test waits, a decode does not
        assert time.monotonic() < deadline, "the background compilation did not end"
        units.poll_background(key)
        time.sleep(0.2)
    assert units.packaged[key] is not None and key in units.compiled_now and units.background is None
    assert len(list(tmp_path.glob("step-*.pt2"))) == 1
    uncompiled.clear()
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, batch))
    assert not uncompiled  # no other step unit was needed
    # once a step's unit is stored, the encoder's is compiled in the background (fairseq's encoder meanwhile)
    encoder = ("encoder", None if batch > 1 else 1)
    assert units.background is not None and units.background[0] == encoder or encoder in units.packaged
    while encoder not in units.packaged:
        assert time.monotonic() < deadline, "the background compilation did not end"
        units.poll_background(encoder)
        time.sleep(0.2)
    assert units.packaged[encoder] is not None and len(list(tmp_path.glob("encoder-*.pt2"))) == 1
    assert not [name for name in units.packaged[encoder].constant_names() if "embed_tokens" in name]  # an input

    later = toy.generator(**options)
    assert_same_tokens_close_scores(expected, translate_batches(toy, later, ids, batch))
    assert later.runner.units.background is None and later.runner.units.packaged[key] is not None
    assert later.runner.units.compiled_now == set()


def test_a_step_that_cannot_be_compiled_runs_eager_with_one_line(toy, tmp_path, monkeypatch, caplog):
    if not onednn_linear_module.onednn_available():
        pytest.skip("the step above the row buckets is compiled on the CPU with oneDNN only")
    from fairseq_fastgen.engine import aot_step

    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    monkeypatch.setattr(aot_step, "compile_package", lambda *args: (_ for _ in ()).throw(RuntimeError("no compiler")))
    ids = SENTENCES[:24]
    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        generator, actual = decode(toy, ids, 8, step_engine="compiled", compiled_many_rows="unit", decoder="greedy",
                                   beam=1)
    assert_same_tokens_close_scores(expected, actual)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "--step-engine compiled: the encoder for more rows could not be compiled ahead of time (RuntimeError: no "
        "compiler); fairseq's encoder runs",
        "--step-engine compiled: the step above 2 rows could not be compiled ahead of time (RuntimeError: no "
        "compiler); those steps run eager",
    ]
    assert generator.runner.many_rows_step is None and not list(tmp_path.glob("step-*.pt2"))


def test_a_compiling_program_holds_the_lock_other_processes_compile_it_behind(tmp_path, monkeypatch):
    """AOTInductor rewrites a graph's generated files in inductor's cache directory in place: while one process
    compiles a program, another cannot take that program's compilation lock (two test workers compiling the same
    encoder once packaged each other's half-written metadata), while another program's is free; both are free
    again once the package is stored."""
    import subprocess
    import sys

    import torch._inductor as inductor

    from fairseq_fastgen.engine import aot_step

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    try_lock = ("import sys, filelock\ntry:\n    filelock.FileLock(sys.argv[1], timeout=0).acquire()\n"
                "except filelock.Timeout:\n    sys.exit(3)")

    def status_of(lock):  # 3: held by another process, 0: free
        return subprocess.run([sys.executable, "-c", try_lock, str(lock)]).returncode

    class Package:
        def __init__(self, program):
            self.program = program

        def export(self):
            return self.program

        @staticmethod
        def settings():
            return {"freezing": True}

    settings = dict(Package.settings(), autotune_num_choices_displayed=0)
    seen = []

    def aoti_compile_and_package(exported, package_path, inductor_configs):
        assert inductor_configs == settings
        held, other = aot_step.aot_compile_lock(exported, settings), aot_step.aot_compile_lock("graph B", settings)
        seen.append((held.parent == tmp_path / "inductor" / "locks", held != other, status_of(held), status_of(other)))
        Path(package_path).write_bytes(b"package")

    monkeypatch.setattr(inductor, "aoti_compile_and_package", aoti_compile_and_package)
    assert aot_step.compile_once(Package("graph A"), tmp_path / "unit.pt2")
    assert seen == [(True, True, 3, 0)] and (tmp_path / "unit.pt2").read_bytes() == b"package"
    assert status_of(aot_step.aot_compile_lock("graph A", settings)) == 0
    assert not aot_step.compile_once(Package("graph A"), tmp_path / "unit.pt2") and len(seen) == 1


def test_shapes_beyond_dynamos_recompile_limit_run_eager_with_one_line(toy, monkeypatch, caplog):
    """A process that meets more step shapes than dynamo compiles (a server running for days) runs the others
    eager, named once, instead of failing the decode; fairseq's tokens all the same."""
    from fairseq_fastgen.engine import compiled_units

    monkeypatch.setattr(compiled_units, "MAX_BUCKETS", 2)
    torch._dynamo.reset()
    ids = SENTENCES[:24]
    _, expected = decode(toy, ids, 2, step_engine="fairseq", decoder="greedy", beam=1)
    # dynamo's own way to change its settings for a while (monkeypatch's undo leaves its config without the name)
    with torch._dynamo.config.patch(recompile_limit=2):
        with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
            generator, actual = decode(toy, ids, 2, step_engine="compiled", decoder="greedy", beam=1)
    torch._dynamo.reset()
    assert_same_tokens_close_scores(expected, actual)
    units = generator.runner.units
    assert 1 <= len(units.compiled_shapes) <= 2 and units.eager_shapes
    assert not units.eager_shapes & units.compiled_shapes.keys()
    ours = [r.getMessage() for r in caplog.records if r.name == "fairseq_fastgen.engine"]
    assert [message for message in ours if "limit" in message] == [
        f"--step-engine compiled: {len(units.compiled_shapes)} step shapes compiled in this process, dynamo's limit; "
        "further shapes run uncompiled"]


@pytest.mark.parametrize(
    "options", [dict(decoder="var-batch", beam=5), dict(decoder="var-stream", beam=5, stream_capacity=16)]
)
def test_compilations_stay_at_the_buckets(toy, options):
    """A whole decode at batch 64 compiles once per (rows, positions, source) bucket, not per batch or step."""
    torch._dynamo.reset()
    counters.clear()
    generator, _ = decode(toy, list(range(200)), 64, step_engine="compiled", compiled_many_rows="unit", **options)
    shapes = generator.runner.units.compiled_shapes
    # dynamo's graphs are the fixed-shape buckets; one more step, compiled ahead of time, serves every row
    # count above them (on the CPU with oneDNN)
    assert counters["stats"]["unique_graphs"] == len(shapes)
    above = generator.runner.many_rows_step is not None
    assert above == generator.runner.many_rows_on_cpu
    assert generator.runner.statistics()["compiled_buckets"] == len(shapes) + above
    row_buckets = {rows for rows, _, _ in shapes}
    assert row_buckets <= {1, 2, 4, 8, 16} and len({width for _, _, width in shapes}) <= 4
    assert len(shapes) < generator.counters.counts["model_calls"] / 10


@pytest.mark.parametrize("options", [dict(decoder="var-batch", beam=4), dict(decoder="var-stream", beam=5,
                                                                            stream_capacity=16)])
def test_symbolic_buckets_serve_every_row_count_with_one_compilation(toy, options):
    """CUDA's form of the compiled engine, run here on the CPU (without its CUDA graphs): rows padded to powers
    of two up to CUDA_MAX_ROWS, every bucket served by one compilation whose shapes are symbolic (dynamo may
    compile the one-row bucket apart, its size-1 row dimension specialised); fairseq's tokens."""
    _, expected = decode(toy, SENTENCES, 32, step_engine="fairseq", **options)
    generator = toy.generator(step_engine="compiled", **options)
    runner = generator.runner
    runner.units.symbolic, runner.units.max_rows, runner.units.packages = True, compiled.CUDA_MAX_ROWS, False
    torch._dynamo.reset()
    counters.clear()
    from tests.engine.test_static_engine import translate_batches

    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, SENTENCES, 32))
    row_buckets = {rows for rows, _, _ in runner.units.compiled_shapes}
    assert len(row_buckets) >= 3 and max(row_buckets) > compiled.COMPILED_MAX_ROWS
    assert all(rows & (rows - 1) == 0 for rows in row_buckets)  # powers of two
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def test_unsupported_decoder_falls_back_with_its_reason(toy, monkeypatch, caplog):
    monkeypatch.setattr(toy.models[0].decoder, "cross_self_attention", True)
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled")
    assert type(generator.runner) is ModelRunner
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["--step-engine compiled: --cross-self-attention is not supported; using --step-engine fairseq"]


@pytest.mark.parametrize("freezing,batch_size", [(False, 8), (True, 1)])
def test_frozen_weights_follow_a_weight_change(toy, monkeypatch, freezing, batch_size):
    """The compiled steps that hold the weights as constants (the step above the row buckets, at batch 8; with
    --compiled-freezing the 1-row bucket, at batch 1, whose float32 products the plugin's kernel of a few rows
    computes on the decoder's weights in place where it runs) give fairseq's tokens, and after an in-place update of
    a decoder weight another step is compiled and gives the updated model's tokens."""
    from fairseq_fastgen.engine import aot_step
    from fairseq_fastgen.ops import int8_kernel

    products, package = [], aot_step.StepPackage.__init__  # (rows, the products' kind) of each unit described
    monkeypatch.setattr(aot_step.StepPackage, "__init__", lambda self, step, table, rows=None: products.append(
        (rows, type(step.decoder_step.reduced).__name__)) or package(self, step, table, rows))
    ids = SENTENCES[:24]
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_freezing=freezing,
                              compiled_many_rows="unit")
    runner = generator.runner
    assert type(runner) is CompiledRunner and runner.freezing == freezing
    if not runner.many_rows_on_cpu:
        pytest.skip("steps are compiled ahead of time on the CPU with oneDNN only")
    from tests.engine.test_static_engine import translate_batches

    _, expected = decode(toy, ids, batch_size, step_engine="fairseq", decoder="greedy", beam=1)
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, batch_size))
    key = 1 if freezing else None  # the package of the 1-row bucket, or of every row count above the buckets
    first_step = runner.units.packaged.get(key)
    assert first_step is not None
    weight = toy.models[0].decoder.layers[-1].fc2.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)  # another model: other tokens
        _, changed = decode(toy, ids, batch_size, step_engine="fairseq", decoder="greedy", beam=1)
        assert any(not torch.equal(changed[s][0]["tokens"], expected[s][0]["tokens"]) for s in ids)
        assert_same_tokens_close_scores(changed, translate_batches(toy, generator, ids, batch_size))
        assert runner.units.packaged.get(key) not in (None, first_step)  # compiled again, for the new weights
        kernel = "F32RowsWeights" if freezing and int8_kernel.f32_rows_available() else "NoneType"
        assert products == [(key, kernel)] * 2  # the unit before the change and after it
    finally:
        with torch.no_grad():
            weight.copy_(original)


def test_frozen_buckets_reach_8_rows_for_one_row_a_sentence_and_4_for_beams_sharing_their_keys(toy):
    """Greedy at batch 8 with --compiled-freezing: its steps of 5-8 rows run the frozen bucket of 8 rows, none the
    unit for many rows, and give fairseq's tokens; a runner of fairseq's beam search (beams sharing their
    encoder-decoder keys) keeps its buckets up to 4 rows, its beams' own unit above them."""
    from fairseq_fastgen.engine.choice import make_runner
    from tests.engine.test_static_engine import translate_batches

    ids = SENTENCES[:16]
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_freezing=True,
                              compiled_many_rows="unit")
    runner = generator.runner
    if not runner.many_rows_on_cpu:
        pytest.skip("steps are compiled ahead of time on the CPU with oneDNN only")
    assert runner.max_rows == 8
    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 8))
    assert runner.units.packaged.get(8) is not None and runner.many_rows_step is None
    beams = make_runner("compiled", toy.models[0], 1.0, None, freezing=True, beams=4)
    assert beams.max_rows == 4


@pytest.mark.parametrize("decoder,beam", [("greedy", 1), ("beam", 4)])
def test_freezing_without_the_compiled_engine_is_refused(toy, decoder, beam):
    refusal = "--compiled-freezing applies to --step-engine compiled; got --step-engine static"
    with pytest.raises(ValueError, match=refusal):
        toy.generator(decoder=decoder, beam=beam, step_engine="static", compiled_freezing=True)


@pytest.mark.parametrize("finished", [[0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0], [1] + [0] * 11, [0] * 11 + [1],
                                      [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])
def test_finished_rows_leave_by_moving_only_the_rows_behind_them(finished):
    """The compiled engine's surviving rows: every kept row once, in place but for the last ones, which fill the
    finished rows' places; the cache then copies those rows only, within its buffers, and holds what an ordered
    gather of the same rows holds."""
    finished = torch.tensor(finished, dtype=torch.bool)
    index = CompiledRunner.surviving_rows(finished)  # (kept,)
    kept = (~finished).nonzero().squeeze(1)
    assert sorted(index.tolist()) == kept.tolist()
    moved = index.ne(torch.arange(index.numel())).nonzero().squeeze(1)
    assert moved.tolist() == [row for row in finished.nonzero().squeeze(1).tolist() if row < kept.numel()]

    rows, heads, capacity, head_dim, src_len = finished.numel(), 4, 16, 8, 9
    cache = StaticCache(capacity)
    cache.start([torch.randn(rows, heads, src_len, head_dim) for _ in range(2)],
                [torch.randn(rows, heads, src_len, head_dim) for _ in range(2)],
                torch.rand(rows, src_len) < 0.2, heads, head_dim)
    for buffer in cache.self_keys + cache.self_values:
        buffer.normal_()
    cache.length = 5
    before = {name: [b.clone() for b in getattr(cache, name)]
              for name in ("self_keys", "self_values", "cross_keys", "cross_values")}
    mask, pointers = cache.cross_mask.clone(), [b.data_ptr() for b in cache.self_keys + cache.cross_values]
    cache.select(index)
    for name, buffers in before.items():
        for want, got in zip(buffers, getattr(cache, name)):
            assert torch.equal(got, want.index_select(0, index)), name
    assert torch.equal(cache.cross_mask, mask.index_select(0, index))
    assert [b.data_ptr() for b in cache.self_keys + cache.cross_values] == pointers  # no new buffers
    assert cache.real_rows == index.numel()


def test_a_cache_sharing_its_buffers_is_not_written_by_a_select():
    """A copy (streaming's rows taken from a group started ahead) shares the buffers: neither selects in place."""
    rows, heads, capacity, head_dim = 6, 2, 8, 4
    cache = StaticCache(capacity)
    cache.start([torch.randn(rows, heads, 5, head_dim)], [torch.randn(rows, heads, 5, head_dim)], None, heads, head_dim)
    for buffer in cache.self_keys + cache.self_values:
        buffer.normal_()
    cache.length = 5
    copied = cache.copy()
    original = [b.clone() for b in cache.self_keys + cache.cross_keys]
    copied.select(CompiledRunner.surviving_rows(torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.bool)))
    assert all(torch.equal(b, o) for b, o in zip(cache.self_keys + cache.cross_keys, original))
    assert torch.equal(copied.self_keys[0][:, :, :5], original[0][[5, 1, 2, 3, 4], :, :5])  # the written positions


def test_greedy_on_the_compiled_engine_moves_few_rows_and_keeps_fairseqs_tokens(toy, monkeypatch):
    """Above the row buckets, sentences ending one by one leave through the in-place select, with fairseq's
    tokens for every sentence."""
    applied = []
    moves_in_place = StaticCache._moves_in_place

    def counted(cache, index, capacity):
        moves = moves_in_place(cache, index, capacity)
        applied.append(moves is not None)
        return moves

    monkeypatch.setattr(StaticCache, "_moves_in_place", counted)
    _, expected = decode(toy, SENTENCES[:40], 20, step_engine="fairseq", decoder="greedy", beam=1)
    _, actual = decode(toy, SENTENCES[:40], 20, step_engine="compiled", decoder="greedy", beam=1)
    assert_same_tokens_close_scores(expected, actual)
    assert any(applied)


def test_a_bucket_step_shrinks_buffers_whose_positions_went_to_the_smallest_bucket(toy):
    """A bucket's compiled step reads every position of its buffers: where a cache holds far fewer positions than
    its buffers (a stream whose first positions went, here the last ones dropped), the next step of a bucket's
    rows shrinks them to the smallest bucket that holds its positions, with the numbers of a cache that never
    grew past it."""
    generator = toy.generator(step_engine="compiled", decoder="greedy", beam=1)
    runner = generator.runner
    sample = toy.sample(SENTENCES[:2])
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
        tokens = torch.randint(4, len(toy.task.target_dictionary), (2, 40), generator=torch.Generator().manual_seed(0))
        tokens[:, 0] = toy.task.target_dictionary.eos()
        grown, fresh = runner.new_cache(), runner.new_cache()
        for length in range(1, 41):
            runner.step(tokens[:, :length], encoder_out, grown)
        assert grown.capacity == compiled.bucket_capacity(40) > compiled.bucket_capacity(11)
        runner.drop_last_positions(grown, 30)  # 10 positions left in buffers of 64
        for length in range(1, 11):
            runner.step(tokens[:, :length], encoder_out, fresh)
        want = runner.step(tokens[:, :11], encoder_out, fresh)
        got = runner.step(tokens[:, :11], encoder_out, grown)
    assert 2 <= runner.max_rows
    assert grown.capacity == fresh.capacity == compiled.bucket_capacity(11)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
