"""Session fixtures: the toy corpus and a tiny transformer trained on it.

Built once (cached under ~/.cache/fairseq_fastgen, or $FASTGEN_CACHE, keyed by
the sources that produce them) and shared by the pytest-xdist workers.
"""

import inspect
import os
import sys

# The test machines have 2 cores and pytest runs 2 workers: one thread per process (each worker and every fairseq
# process a test starts; a test that wants more says so) keeps thread pools from oversubscribing the cores, where a
# run of small products goes several times slower. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# --step-engine auto (the default) compiles a new model's steps in child processes on the CPU: the tests that do not
# name an engine run static, bitwise fairseq's (as stock fairseq-generate, which many compare against); the tests
# of auto itself clear this (tests/engine/test_auto_engine.py).
os.environ.setdefault("FASTGEN_STEP_ENGINE", "static")
# Compiling the units ahead of time (AOTInductor) dominates the slowest tests, much of it gcc: the tests build each
# package's wrapper (the C++ that calls the kernels in order; torch's default -O1) at -O0. With cold caches
# test_compiled_engine.py and test_compiled_int8.py took 350 s against 407 (-n 2). The kernels keep -O3: the same
# arithmetic.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastgen_demo import synthetic, toy  # noqa: E402

TOY_SPEC = toy.ToyModelSpec(max_update=200, validate_interval=1000)


@dataclass
class ToyModel:
    root: Path
    raw: Path  # raw text: train/valid/test .en/.fr
    data_bin: Path  # fairseq-preprocess output
    checkpoint: Path  # trained tiny transformer


def toy_model_dir(spec=TOY_SPEC):
    # rebuilt only when the corpus generator, the build steps or the spec change
    steps = (toy.build_toy_model, toy.binarize, toy.train, toy.make_corpus, toy.ToyModelSpec.train_args)
    key = [toy.source_fingerprint(synthetic), *(inspect.getsource(f) for f in steps), repr(spec)]
    return toy.cached_build("toy-transformer", key, lambda d: toy.build_toy_model(d, spec))


@pytest.fixture(scope="session")
def toy_model() -> ToyModel:
    root = toy_model_dir()
    return ToyModel(root, root / "raw", root / "bin", root / "ckpt" / "checkpoint_last.pt")


@pytest.fixture(scope="session")
def toy_spec() -> toy.ToyModelSpec:
    return TOY_SPEC


@pytest.fixture(scope="session")
def plugin_dir() -> str:
    return toy.PLUGIN_DIR
