"""Fixtures of the fastgen-distill tests: a reference distillation of the toy
model's valid split that other runs are compared with."""

from types import SimpleNamespace

import pytest

from tests.distill.distill_runs import ONE_THREAD, REFERENCE_ARGS, run_distill


@pytest.fixture(scope="session")
def reference_run(toy_model, tmp_path_factory):
    """One process distilling the valid split with REFERENCE_ARGS."""
    out = tmp_path_factory.mktemp("distill") / "reference"
    completed = run_distill(toy_model, out, *REFERENCE_ARGS, env=ONE_THREAD)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return SimpleNamespace(out=out, output=completed.stdout + completed.stderr)
