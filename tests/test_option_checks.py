"""Every numeric option of the plugin is refused, naming it, when it is not finite or out of range."""

import math
import subprocess
import typing
from types import SimpleNamespace

import pytest

import fairseq_fastgen  # noqa: F401  (registers the decoders: their options are checked too)
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.option_checks import (
    GENERATION_OPTIONS,
    check_generation_options,
    require_finite_in_range,
    require_int,
)
from fairseq_fastgen.options import parse_options
from fairseq_fastgen.registry import DECODERS
from fastgen_demo import toy
from tests.test_foundation_cli import generate

NAN, INF = math.nan, math.inf


# ---- the checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, allow_inf, message", [
    (NAN, False, "--opt must be a finite number in [0, 1], got nan"),
    (INF, False, "--opt must be a finite number in [0, 1], got inf"),
    (-INF, False, "--opt must be a finite number in [0, 1], got -inf"),
    (-0.5, False, "--opt must be a finite number in [0, 1], got -0.5"),
    (1.5, False, "--opt must be a finite number in [0, 1], got 1.5"),
    ("0.5", False, "--opt must be a finite number in [0, 1], got '0.5'"),
    (True, False, "--opt must be a finite number in [0, 1], got True"),
    (NAN, True, "--opt must be a number in [0, 1] or inf, got nan"),
])
def test_reals_outside_their_range_are_refused(value, allow_inf, message):
    with pytest.raises(ValueError) as refusal:
        require_finite_in_range("--opt", value, 0, 1, allow_inf=allow_inf)
    assert str(refusal.value) == message


def test_reals_inside_their_range_pass():
    assert require_finite_in_range("--opt", 0, 0, 1) == 0.0
    assert require_finite_in_range("--opt", 1.0, 0, 1) == 1.0
    assert require_finite_in_range("--opt", INF, 0, allow_inf=True) == INF
    with pytest.raises(ValueError, match="got -inf"):  # inf passes only where no bound excludes it
        require_finite_in_range("--opt", -INF, 0, allow_inf=True)


@pytest.mark.parametrize("value, shown", [(0, "0"), (5, "5"), (2.0, "2.0"), (NAN, "nan"), (True, "True"), ("2", "'2'")])
def test_integers_outside_their_range_are_refused(value, shown):
    with pytest.raises(ValueError) as refusal:
        require_int("--opt", value, 1, 4)
    assert str(refusal.value) == f"--opt must be an integer in [1, 4], got {shown}"


def test_the_caller_chooses_the_error_type():
    class Refusal(Exception):
        pass

    with pytest.raises(Refusal, match="--opt must be an integer >= 1, got 0"):
        require_int("--opt", 0, 1, error=Refusal)
    assert require_int("--opt", 3, 1) == 3


# ---- the generation options ---------------------------------------------------------------------------
def numeric_fields():
    classes = [PluginOptions] + [e.options for e in DECODERS.values() if e.options is not None]
    names = set()
    for cls in classes:
        for name, annotation in typing.get_type_hints(cls).items():
            types = set(typing.get_args(annotation)) - {type(None)} or {annotation}
            if types & {int, float}:
                names.add(name)
    return names


def test_every_numeric_generation_option_is_checked():
    assert numeric_fields() == set(GENERATION_OPTIONS)


BAD_GENERATION_OPTIONS = [
    ("var_beam_delta", NAN, "--var-beam-delta must be a number >= 0 or inf, got nan"),
    ("var_beam_delta", -1.0, "--var-beam-delta must be a number >= 0 or inf, got -1.0"),
    ("var_beam_delta", -INF, "--var-beam-delta must be a number >= 0 or inf, got -inf"),
    ("var_beam_max_cands", 0, "--var-beam-max-cands must be an integer >= 1, got 0"),
    ("blockwise_block_size", 0, "--blockwise-block-size must be an integer >= 1, got 0"),
    ("blockwise_block_size", -2, "--blockwise-block-size must be an integer >= 1, got -2"),
    ("blockwise_top_k", -1, "--blockwise-top-k must be an integer >= 0, got -1"),
    ("blockwise_epsilon", NAN, "--blockwise-epsilon must be a finite number >= 0, got nan"),
    ("blockwise_epsilon", INF, "--blockwise-epsilon must be a finite number >= 0, got inf"),
    ("blockwise_epsilon", -0.5, "--blockwise-epsilon must be a finite number >= 0, got -0.5"),
    ("blockwise_min_block", 0, "--blockwise-min-block must be an integer >= 1, got 0"),
    ("cluster_nearest", 0, "--cluster-nearest must be an integer >= 1, got 0"),
    ("stream_eps", NAN, "--stream-eps must be a finite number in [0, 1], got nan"),
    ("stream_eps", 1.5, "--stream-eps must be a finite number in [0, 1], got 1.5"),
    ("stream_capacity", 0, "--stream-capacity must be an integer >= 1, got 0"),
    ("stream_capacity_tokens", -5, "--stream-capacity-tokens must be an integer >= 1, got -5"),
    ("stream_capacity_rows", 0, "--stream-capacity-rows must be an integer >= 1, got 0"),
    ("stream_pool", 0, "--stream-pool must be an integer >= 1, got 0"),
    ("stream_set_aside", -1, "--stream-set-aside must be an integer >= 0, got -1"),
    ("postprocess_workers", -1, "--postprocess-workers must be an integer >= 0, got -1"),
]


@pytest.mark.parametrize("name, value, message", BAD_GENERATION_OPTIONS)
def test_bad_generation_options_are_refused_by_name(name, value, message):
    with pytest.raises(ValueError) as refusal:
        check_generation_options(parse_options(SimpleNamespace(**{name: value})))
    assert str(refusal.value) == message


@pytest.mark.parametrize("name, value", [
    ("var_beam_delta", INF), ("var_beam_delta", 0.0), ("stream_eps", 0.0), ("stream_eps", 1.0),
    ("blockwise_block_size", None), ("blockwise_block_size", 1), ("blockwise_epsilon", None),
    ("blockwise_epsilon", 0.0), ("blockwise_top_k", 0), ("stream_capacity", None), ("postprocess_workers", 0),
    ("stream_set_aside", 0),
])
def test_valid_generation_options_pass(name, value):
    check_generation_options(parse_options(SimpleNamespace(**{name: value})))


def test_the_defaults_pass():
    check_generation_options(parse_options(SimpleNamespace()))  # every option at its declared default


def test_build_generator_refuses_them_for_every_decoder(toy_model):
    """The hub interface and Python callers go through task.build_generator: greedy reads none of
    these options itself, yet an out-of-range one is refused there."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy_model.checkpoint)], arg_overrides={"data": str(toy_model.data_bin)})
    with pytest.raises(ValueError, match=r"^--var-beam-delta must be a number >= 0 or inf, got nan$"):
        task.build_generator(models, GenerationConfig(decoder="greedy", beam=1, var_beam_delta=NAN))
    assert task.build_generator(models, GenerationConfig(decoder="greedy", beam=1, var_beam_delta=INF)) is not None


# ---- fairseq-generate / fairseq-interactive ----------------------------------------------------------
@pytest.mark.xdist_group("test_option_checks")
def test_fairseq_generate_refuses_a_nan_delta(toy_model):
    """A NaN delta decoded every sentence to an empty hypothesis, exit status 0."""
    result = generate(toy_model, "--decoder", "var-batch", "--var-beam-delta", "nan")
    assert result.returncode != 0
    assert "--var-beam-delta must be a number >= 0 or inf, got nan" in result.stderr
    assert "H-" not in result.stdout


@pytest.mark.xdist_group("test_option_checks")
@pytest.mark.parametrize("tool, options, message", [
    ("generate", ["--decoder", "blockwise", "--beam", "1", "--blockwise-block-size", "0"],
     "--blockwise-block-size must be an integer >= 1, got 0"),
    ("interactive", ["--decoder", "var-stream", "--stream-eps", "inf"],
     "--stream-eps must be a finite number in [0, 1], got inf"),
])
def test_the_commands_refuse_before_loading_the_model(tmp_path, tool, options, message):
    """The options are checked first: the (missing) checkpoint is never opened."""
    command = toy.fairseq_command(tool) + [str(tmp_path), "--path", str(tmp_path / "missing.pt"), "--cpu",
                                            "--user-dir", toy.PLUGIN_DIR, *options]
    result = subprocess.run(command, capture_output=True, text=True, input="")
    assert result.returncode != 0
    assert message in result.stderr
    assert "missing.pt" not in result.stderr
