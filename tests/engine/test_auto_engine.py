"""--step-engine auto, the default: on the CPU in float32 or int8 the compiled engine with its row buckets frozen
and its units compiled in the background (a first run never waits for the compiler); static where the compiled
engine has nothing faster (CUDA, half precision, bfloat16); $FASTGEN_STEP_ENGINE names another engine for it.

The other tests run with $FASTGEN_STEP_ENGINE=static (tests/conftest.py); these clear it."""

import importlib
import os
import re
import time

import pytest
import torch
from torch import nn

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import choice
from fairseq_fastgen.engine.choice import EngineChoice, engine_choice
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.runners import StaticRunner
from fairseq_fastgen.ops import int8_kernel, precision_linear
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)
from tests.test_foundation_cli import generate, hypotheses

onednn_linear = importlib.import_module("fairseq_fastgen.ops.onednn_linear")  # ops/ re-exports its function
BACKGROUND_LINE = re.compile(r"is compiled in the background \(process (\d+),")


@pytest.fixture
def auto(monkeypatch):
    monkeypatch.delenv(choice.AUTO_ENGINE_ENV, raising=False)


def test_auto_is_the_default_and_runs_compiled_frozen_in_the_background_on_the_cpu(auto):
    assert PluginOptions().step_engine == "auto"
    assert engine_choice(PluginOptions()) == EngineChoice("compiled", freezing=True, background=True)
    assert engine_choice(PluginOptions(), nn.Linear(2, 2)) == EngineChoice("compiled", True, True)


def test_auto_runs_static_where_compiled_has_no_faster_units(auto):
    half = nn.Linear(2, 2).half()
    assert engine_choice(PluginOptions(), half) == EngineChoice("static")
    assert engine_choice(PluginOptions(quantize="int8", int8_library_kernels=True)) == EngineChoice("static")
    if torch.cuda.is_available():
        assert engine_choice(PluginOptions(), nn.Linear(2, 2).cuda()) == EngineChoice("static")


def test_auto_runs_compiled_int8_where_the_plugins_kernel_runs(auto):
    expected = EngineChoice("compiled", True, True) if int8_kernel.available() else EngineChoice("static")
    assert engine_choice(PluginOptions(quantize="int8")) == expected


def test_auto_runs_compiled_bf16_where_the_processor_multiplies_bfloat16(auto):
    native = precision_linear.precision_refusal("bf16") is None
    expected = EngineChoice("compiled", True, True) if native else EngineChoice("static")
    assert engine_choice(PluginOptions(quantize="bf16")) == expected


def test_the_environment_names_the_engine_auto_runs(monkeypatch):
    for engine in ("static", "fairseq"):
        monkeypatch.setenv(choice.AUTO_ENGINE_ENV, engine)
        assert engine_choice(PluginOptions()) == EngineChoice(engine)
    monkeypatch.setenv(choice.AUTO_ENGINE_ENV, "compiled")  # the engine as named, its flags as given
    assert engine_choice(PluginOptions()) == EngineChoice("compiled")
    assert engine_choice(PluginOptions(compiled_freezing=True)) == EngineChoice("compiled", freezing=True)
    monkeypatch.setenv(choice.AUTO_ENGINE_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$FASTGEN_STEP_ENGINE must be one of fairseq, static, compiled; "
                                         r"got 'fast'"):
        engine_choice(PluginOptions())
    # an engine named on the command line wins
    assert engine_choice(PluginOptions(step_engine="static")) == EngineChoice("static")


def test_a_generator_built_without_an_engine_option_holds_the_compiled_runner(toy, auto):
    runner = toy.generator(decoder="greedy", beam=1).runner
    assert type(runner) is CompiledRunner
    assert runner.units.freezing and runner.units.compile_in_background
    pinned = toy.generator(decoder="greedy", beam=1, step_engine="static").runner
    assert type(pinned) is StaticRunner


def test_fairseq_generate_without_an_engine_option_decodes_at_once_and_compiles_beside(toy_model, tmp_path,
                                                                                     monkeypatch, auto):
    """A first run on a new model: the compiled engine's tokens (fairseq's, as static gives them), one line naming
    the child process that compiles a unit into $FASTGEN_COMPILED_DIR while the steps run eager."""
    if not onednn_linear.onednn_available():
        pytest.skip("the steps compiled ahead of time are compiled on the CPU with oneDNN only")
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    options = ["--decoder", "greedy", "--beam", "1", "--batch-size", "16"]
    first = generate(toy_model, *options)
    children = [int(pid) for pid in BACKGROUND_LINE.findall(first.stderr)]
    try:
        assert first.returncode == 0, first.stderr[-2000:]
        assert len(children) == 1, first.stderr[-2000:]  # one unit at a time
        static = generate(toy_model, *options, "--step-engine", "static")
        expected = {sid: text for sid, (text, _) in hypotheses(static.stdout).items()}
        assert {sid: text for sid, (text, _) in hypotheses(first.stdout).items()} == expected
        assert len(expected) == len((toy_model.raw / "test.en").read_text().splitlines())
    finally:
        for pid in children:  # the child would finish and store the unit; the test does not wait for it
            stop(pid)


def stop(pid: int):
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
