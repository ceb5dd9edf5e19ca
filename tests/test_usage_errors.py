"""A misuse of the plugin through the real fairseq-generate / fairseq-interactive: one ``error:`` line naming the
problem, exit status 2, no traceback; the hub interface and task.build_generator raise the plugin's UsageError."""

import pytest

from fairseq_fastgen.option_checks import UsageError
from tests.test_foundation_cli import generate, interactive

pytestmark = pytest.mark.xdist_group("toy_cli")

MISUSES = {
    "decoder vs options": (["--decoder", "greedy", "--nbest", "2"],
                           "--decoder greedy produces one hypothesis per sentence; got --nbest 2"),
    "decoder vs model": (["--decoder", "blockwise", "--beam", "1"], "--decoder blockwise needs a k-head model"),
    "engine": (["--decoder", "greedy", "--beam", "1", "--compiled-freezing"],
               "--compiled-freezing applies to --step-engine compiled"),
    "streaming option": (["--decoder", "var-stream", "--beam", "4", "--stream-eps", "2"], "--stream-eps"),
    # issue 30 item 2: 0 was read as "every head"; refused before the model loads, whatever the model
    "block size 0": (["--decoder", "blockwise", "--beam", "1", "--blockwise-block-size", "0"],
                     "--blockwise-block-size must be an integer >= 1, got 0"),
    "cluster file": (["--decoder", "greedy", "--beam", "1", "--cluster-projection", "/nonexistent/clusters.pt"],
                     "/nonexistent/clusters.pt"),
}


def assert_one_error_line(result, tool, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"fairseq-{tool}: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_fairseq_generate_refuses_a_misuse_in_one_line(toy_model, misuse):
    options, message = MISUSES[misuse]
    assert_one_error_line(generate(toy_model, *options), "generate", message)


@pytest.mark.parametrize("misuse", ["decoder vs model", "engine"])
def test_fairseq_interactive_refuses_a_misuse_in_one_line(toy_model, misuse):
    options, message = MISUSES[misuse]
    result = interactive(toy_model, ["a b c"], *options)
    assert_one_error_line(result, "interactive", message)
    assert not [line for line in result.stdout.splitlines() if line.startswith("H-")]


def test_build_generator_raises_the_plugins_usage_error(toy_model):
    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import GenerationConfig

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy_model.checkpoint)], arg_overrides={"data": str(toy_model.data_bin)}
    )
    with pytest.raises(UsageError, match="--decoder blockwise needs a k-head model"):
        task.build_generator(models, GenerationConfig(decoder="blockwise", beam=1))
