"""Load fairseq checkpoints under torch's ``weights_only`` unpickler.

Since torch 2.6 ``torch.load`` refuses every global it does not know, and every
fairseq checkpoint pickles a few (``argparse.Namespace`` for legacy args, numpy
arrays and scalars for the meters of ``--eval-bleu`` runs).  The plugin never
disables that protection globally; it allows exactly the globals fairseq's own
training writes.  Any other
global is still refused, with a message naming it and the explicit opt-in:
``FASTGEN_TRUSTED_GLOBALS=module.Name[,module.Other]`` (a builtin by its bare
name, as torch's refusal spells it: ``eval``), read where a checkpoint loads; an
entry that names no global, or one of a module torch never loads (``os``,
``posix``, ``sys``), is refused in one line.  A refusal of such a module's
global does not advise the opt-in: nothing would load it.

A checkpoint that cannot be read at all (cut short by an interrupted copy or a
full disk, damaged, not a torch file) is refused with its path and the reader's
first line (:func:`explain_unreadable`), not with torch's traceback; one that
does not exist or cannot be opened is refused before anything loads
(:func:`check_readable`).
"""

import argparse
import collections
import importlib
import os
import pickle
import re
import zipfile

import numpy as np
import torch

TRUST_ENV = "FASTGEN_TRUSTED_GLOBALS"


def _numpy_globals():
    """numpy callables that pickled arrays and scalars refer to, under both the
    numpy 1.x (``numpy.core``) and numpy 2.x (``numpy._core``) module names."""
    import codecs

    multiarray = np.core.multiarray if not hasattr(np, "_core") else np._core.multiarray
    entries = [
        (codecs.encode, "_codecs.encode"),
        (np.dtype, "numpy.dtype"),
        (np.ndarray, "numpy.ndarray"),
    ]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        entries.append((multiarray._reconstruct, f"{module}._reconstruct"))
        entries.append((multiarray.scalar, f"{module}.scalar"))
    # numpy >= 1.25 pickles a dtype through its class, e.g. numpy.dtypes.Float64DType
    dtype_classes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    entries.extend((cls, f"numpy.dtypes.{cls.__name__}") for cls in dtype_classes)
    return entries


def fairseq_checkpoint_globals():
    """Every global a checkpoint written by fairseq training may reference."""
    return [argparse.Namespace, collections.OrderedDict] + _numpy_globals()


def blocked_modules():
    """The modules whose globals torch's weights_only loader refuses whatever is allowed (os, sys, ...)."""
    from torch import _weights_only_unpickler

    return set(getattr(_weights_only_unpickler, "_blocklisted_modules", ()))


def _resolve(entry):
    """The global an entry of ``FASTGEN_TRUSTED_GLOBALS`` names, as torch's refusal spells it: ``module.Name``, or
    a builtin's bare name (torch writes ``GLOBAL eval`` for ``builtins.eval``)."""
    module_name, _, attr = entry.rpartition(".")
    module_name = module_name or "builtins"
    if module_name.split(".")[0] in blocked_modules():
        raise TrustSettingError(f"{TRUST_ENV}={os.environ.get(TRUST_ENV)}: {entry} is a global of module "
                                f"{module_name}, which torch never loads with weights_only, allowed or not")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise TrustSettingError(f"{TRUST_ENV}={os.environ.get(TRUST_ENV)}: {entry} names no global that can be "
                                f"imported ({type(error).__name__}: {error}); give module.Name as a refusal spells "
                                f"it") from error


def user_trusted_globals():
    """``(global, its full name)`` of each entry of ``FASTGEN_TRUSTED_GLOBALS`` (a builtin's is ``builtins.Name``,
    as the pickle spells it)."""
    names = [n.strip() for n in os.environ.get(TRUST_ENV, "").split(",") if n.strip()]
    return [(_resolve(n), n if "." in n else f"builtins.{n}") for n in names]


def allow_fairseq_checkpoint_globals():
    torch.serialization.add_safe_globals(fairseq_checkpoint_globals())


_trusted_setting = None  # the FASTGEN_TRUSTED_GLOBALS whose globals are allowed


def allow_user_trusted_globals():
    """Allow the globals ``FASTGEN_TRUSTED_GLOBALS`` names (done where a checkpoint loads, not at import, so that an
    entry that names nothing is refused in one line, :class:`TrustSettingError`, by the tool that loads)."""
    global _trusted_setting
    setting = os.environ.get(TRUST_ENV, "")
    if setting != _trusted_setting:
        torch.serialization.add_safe_globals(user_trusted_globals())
        _trusted_setting = setting


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")
_BLOCKED_IN_MESSAGE = re.compile(r"whose module (\w+) is blocked")


# This module imports nothing of the package: stock_fairseq.py loads it by path, without installing the plugin.
class CheckpointRefusal(Exception):
    """A checkpoint that is not loaded, with a message naming it; fairseq-generate and fairseq-interactive print
    it as one error line."""


class UntrustedCheckpointError(pickle.UnpicklingError, CheckpointRefusal):
    """A checkpoint whose pickle references a global outside the allow-list."""


class UnreadableCheckpointError(CheckpointRefusal, ValueError):
    """A checkpoint file that torch cannot read: truncated, damaged or not a checkpoint."""


class TrustSettingError(CheckpointRefusal, ValueError):
    """An entry of ``FASTGEN_TRUSTED_GLOBALS`` that names no global torch could allow."""


# what torch.load raises on a file cut short or damaged (the zip reader, the unpickler, the file itself)
UNREADABLE_ERRORS = (RuntimeError, EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError)


def check_readable(path):
    """Refuse, in one line naming it, a checkpoint path that does not exist, is a directory or cannot be opened."""
    if not os.path.exists(path):
        raise UnreadableCheckpointError(f"checkpoint {path} does not exist")
    if os.path.isdir(path):
        raise UnreadableCheckpointError(f"checkpoint {path} is a directory, not a checkpoint file")
    try:
        open(path, "rb").close()
    except OSError as error:
        raise UnreadableCheckpointError(f"cannot read checkpoint {path}: {error.strerror}") from error


def explain_refusal(path, error):
    """Turn torch's weights_only refusal into a message with the opt-in; a refusal that names no
    global is a damaged file, not a foreign one."""
    found = _GLOBAL_IN_MESSAGE.search(str(error))
    if not found:
        return explain_unreadable(path, error)
    name = found.group(1)
    blocked = _BLOCKED_IN_MESSAGE.search(str(error))
    if blocked:  # torch refuses it whatever is allowed: no setting of ours would load it
        return UntrustedCheckpointError(
            f"refusing to load {path}: its pickle references {name}, and torch never loads a global of module "
            f"{blocked.group(1)} with weights_only, allowed or not (loading it would run arbitrary code); this file "
            f"cannot be loaded here"
        )
    return UntrustedCheckpointError(
        f"refusing to load {path}: its pickle references {name}, which fairseq checkpoints do not "
        f"contain and loading it would run arbitrary code.  If you trust this file, allow that "
        f"global explicitly: {TRUST_ENV}={name} (comma-separated for several)."
    )


def explain_unreadable(path, error):
    """One line naming the file and what the reader said first."""
    return UnreadableCheckpointError(
        f"cannot load checkpoint {path}: the file is truncated, damaged or not a torch checkpoint "
        f"({reader_said(error)})"
    )


def reader_said(error) -> str:
    """What torch's reader said first about a file it cannot read, in one line, after the error's type (not
    torch's paragraphs of advice on switching its protection off)."""
    said = _first_line(error)
    if "WeightsUnpickler error:" in str(error):  # torch's weights_only text hides the reader's own words
        said = str(error).split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
    return f"{type(error).__name__}: {said}"


def _first_line(error, limit=200):
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    line = line.split(". ", 1)[0]  # torch's zip reader adds several sentences of advice
    return line if len(line) <= limit else line[: limit - 3] + "..."
