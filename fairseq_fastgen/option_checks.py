"""Range checks of the plugin's numeric options, one error line each.

Every numeric option is checked where it is parsed or turned into a decoder
setting, with the option's command-line spelling in the message, e.g.
``--var-beam-delta must be a number >= 0 or inf, got nan``.  A NaN fails every
comparison, so ``value < 0`` alone lets it through: the checks below test the
range the value must lie in, never the one it must not.

The checks raise ``error`` (``ValueError`` unless the caller passes its own
refusal type: ``DistillError``, ``ClusterFileError``).  The plugin's generation
options, whichever decoder is selected, are listed in
:data:`GENERATION_OPTIONS` and checked together by
:func:`check_generation_options`, on the options read from ``cfg.generation``
(:func:`fairseq_fastgen.options.parse_options`); limits that need the model (the number of
heads of ``--blockwise-block-size``) are checked when the decoder is built.
"""

import contextlib
import functools
import math
import numbers
import sys
from typing import NamedTuple, Optional

from fairseq_fastgen import checkpoint_safety
from fairseq_fastgen.refusals import UsageError  # re-exported: the type every refusal below becomes


@contextlib.contextmanager
def usage_errors():
    """Inside the block, the plugin's refusals of options and models (``ValueError``) become its one
    :class:`UsageError` type, with the same message."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as error:
        raise UsageError(str(error)) from error


def exit_on_usage_error(program: str):
    """Around a CLI's run: a :class:`UsageError`, or a checkpoint that is not loaded, ends it with one
    ``PROGRAM: error: ...`` line on stderr and exit status 2 (argparse's convention), instead of a traceback."""

    def wrap(run):
        @functools.wraps(run)
        def guarded(*args, **kwargs):
            try:
                return run(*args, **kwargs)
            except (UsageError, checkpoint_safety.CheckpointRefusal) as error:
                print(f"{program}: error: {error}", file=sys.stderr, flush=True)
                sys.exit(2)

        return guarded

    return wrap


def flag(name: str) -> str:
    """The command-line spelling of a config field: ``var_beam_delta`` -> ``--var-beam-delta``."""
    return "--" + name.replace("_", "-")


def _shown(value) -> str:
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return str(float(value))  # nan, inf, 1.5 (not numpy's repr)
    return repr(value)


def _bounds(low, high) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    if low is not None:
        return f">= {low}"
    if high is not None:
        return f"<= {high}"
    return ""


def _refuse(option, wanted, value, error):
    raise error(f"{option} must be {wanted}, got {_shown(value)}")


def require_int(option: str, value, low: Optional[int] = None, high: Optional[int] = None, *, error=ValueError):
    """``value`` is an integer (not a bool, not a float) in [low, high]; None bounds are open."""
    wanted = " ".join(filter(None, ["an integer", _bounds(low, high)]))
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        _refuse(option, wanted, value, error)
    if (low is not None and value < low) or (high is not None and value > high):
        _refuse(option, wanted, value, error)
    return int(value)


def require_finite_in_range(option: str, value, low: Optional[float] = None, high: Optional[float] = None, *,
                            allow_inf: bool = False, error=ValueError):
    """``value`` is a real number in [low, high], not NaN, and finite unless ``allow_inf``
    (then +inf or -inf passes where the bounds admit it)."""
    wanted = " ".join(filter(None, ["a number" if allow_inf else "a finite number", _bounds(low, high),
                                    "or inf" if allow_inf else ""]))
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value):
        _refuse(option, wanted, value, error)
    if math.isinf(value):
        if not allow_inf or (value > 0 and high is not None) or (value < 0 and low is not None):
            _refuse(option, wanted, value, error)
        return float(value)
    if (low is not None and value < low) or (high is not None and value > high):
        _refuse(option, wanted, value, error)
    return float(value)


class Check(NamedTuple):
    kind: str  # "int" or "real"
    low: Optional[float] = None
    high: Optional[float] = None
    optional: bool = False  # None is a valid value (a default computed later)
    allow_inf: bool = False


# Every numeric generation option of the plugin (PluginOptions and the decoders'
# options dataclasses); tests/test_option_checks.py fails when one is missing.
GENERATION_OPTIONS = {
    "postprocess_workers": Check("int", 0),
    "var_beam_delta": Check("real", 0, allow_inf=True),  # inf: no threshold
    "var_beam_max_cands": Check("int", 1),
    "stream_eps": Check("real", 0, 1, optional=True),  # None: the decoder's own (streaming.py)
    "stream_capacity": Check("int", 1, optional=True),
    "stream_capacity_tokens": Check("int", 1, optional=True),
    "stream_capacity_rows": Check("int", 1, optional=True),
    "stream_pool": Check("int", 1),
    "stream_set_aside": Check("int", 0),
    "blockwise_block_size": Check("int", 1, optional=True),  # at most the model's heads: checked at build
    "blockwise_top_k": Check("int", 0),
    "blockwise_epsilon": Check("real", 0, optional=True),
    "blockwise_min_block": Check("int", 1),
    "cluster_nearest": Check("int", 1),  # at most the cluster file's clusters: checked when it is loaded
}


def check_option(name: str, value, check: Check, error=ValueError):
    if value is None and check.optional:
        return None
    if check.kind == "int":
        return require_int(flag(name), value, check.low, check.high, error=error)
    return require_finite_in_range(flag(name), value, check.low, check.high, allow_inf=check.allow_inf, error=error)


# fairseq's own generation options that its search does not check: --beam 0 ends it in a RuntimeError
FAIRSEQ_GENERATION_OPTIONS = {
    "beam": Check("int", 1),
    "nbest": Check("int", 1),
}


def check_fairseq_generation_options(gen_cfg, error=ValueError):
    """Refuse the first of fairseq's options in :data:`FAIRSEQ_GENERATION_OPTIONS` that ``gen_cfg`` holds out of
    range (a config without it, an old checkpoint's, is left alone)."""
    for name, check in FAIRSEQ_GENERATION_OPTIONS.items():
        value = getattr(gen_cfg, name, None)
        if value is not None:
            check_option(name, value, check, error)


def check_generation_options(options, error=ValueError):
    """Refuse the first out-of-range numeric plugin option of ``options`` (the
    :class:`~fairseq_fastgen.options.FastgenOptions` read from ``cfg.generation``)."""
    values = options.by_name()
    for name, check in GENERATION_OPTIONS.items():
        check_option(name, values[name], check, error)
