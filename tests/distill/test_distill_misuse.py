"""A misuse of fastgen-distill through its real command line: one ``fastgen-distill: error:`` line naming the
problem, exit status 2, no traceback, nothing written; with worker processes too (the decoder is checked
against the teacher before any worker starts)."""

import pytest

from tests.distill.distill_runs import ONE_THREAD, run_distill
from tests.test_usage_errors import MISUSES, assert_one_error_line

pytestmark = pytest.mark.xdist_group("toy_distill")

DISTILL_MISUSES = {
    **{misuse: MISUSES[misuse] for misuse in ("decoder vs options", "engine", "streaming option", "cluster file")},
    "decoder vs model": (["--decoder", "blockwise"], MISUSES["decoder vs model"][1]),
    "decoder vs model, two workers": (["--decoder", "blockwise", "--workers", "2"], MISUSES["decoder vs model"][1]),
    "option value": (["--decoder", "var-batch", "--var-beam-delta", "nan"],
                     "--var-beam-delta must be a number >= 0 or inf, got nan"),
    "workers": (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    "checkpoint": (["--path", "/nonexistent/teacher.pt"], "checkpoint /nonexistent/teacher.pt does not exist"),
}


@pytest.mark.parametrize("misuse", list(DISTILL_MISUSES))
def test_fastgen_distill_refuses_a_misuse_in_one_line(toy_model, tmp_path, misuse):
    options, message = DISTILL_MISUSES[misuse]
    out = tmp_path / "out"
    result = run_distill(toy_model, out, "--split", "test", "--cpu", "--no-progress-bar", *options, env=ONE_THREAD)
    assert_one_error_line(result, "fastgen-distill", message)
    assert not list(out.glob("*.bin")) and not (out / "distill-shards").exists()
