"""Fairseq checkpoints load under torch's weights_only unpickler, others are refused."""

import argparse
import dataclasses
import fractions
import os
import re
import subprocess

import numpy as np
import pytest
import torch

import fairseq_fastgen  # noqa: F401  (installs the allow-list)
from fairseq_fastgen.checkpoint_safety import TRUST_ENV
from fastgen_demo import toy
from tests.test_foundation_cli import interactive
from tests.test_usage_errors import assert_one_error_line

pytestmark = pytest.mark.xdist_group("test_checkpoint_safety")


def rewrite_checkpoint(src, dst, **extra_state):
    state = torch.load(src, weights_only=False)
    state["extra_state"].update(extra_state)
    torch.save(state, dst)
    return dst


def generate(toy_model, checkpoint, env=None):
    cmd = toy.fairseq_command("generate") + [str(toy_model.data_bin), "--path", str(checkpoint), "--cpu",
                                             "--user-dir", toy.PLUGIN_DIR, "--beam", "1", "--max-sentences", "8",
                                             "--batch-size", "8", "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def test_plain_torch_load_of_a_fairseq_checkpoint_is_allowed(toy_model):
    state = torch.load(toy_model.checkpoint)  # weights_only=True is torch's default
    model_args = state["cfg"]["model"]  # fairseq pickles the model's args as an argparse.Namespace
    assert isinstance(model_args, argparse.Namespace) and model_args.arch == "transformer"
    assert "encoder.embed_tokens.weight" in state["model"]


def test_checkpoint_with_numpy_meters_loads(toy_model, tmp_path):
    """Runs with --eval-bleu pickle numpy arrays and scalars in extra_state.metrics."""
    meters = {"_bleu_counts_0": np.arange(4, dtype=np.int64), "bleu": np.float64(31.5), "ratio": np.float32(0.9)}
    checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "meters.pt", metrics={"valid": meters})
    state = torch.load(checkpoint)
    assert np.array_equal(state["extra_state"]["metrics"]["valid"]["_bleu_counts_0"], np.arange(4))
    result = generate(toy_model, checkpoint)
    assert result.returncode == 0, result.stderr[-2000:]


def test_foreign_global_is_refused_with_the_opt_in(toy_model, tmp_path):
    checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "foreign.pt", payload=fractions.Fraction(1, 3))
    refused = generate(toy_model, checkpoint)
    assert refused.returncode != 0
    assert "fractions.Fraction" in refused.stderr and f"{TRUST_ENV}=fractions.Fraction" in refused.stderr
    trusted = generate(toy_model, checkpoint, env=dict(os.environ, **{TRUST_ENV: "fractions.Fraction"}))
    assert trusted.returncode == 0, trusted.stderr[-2000:]


def damaged_copies(checkpoint, directory):
    """A checkpoint cut short (an interrupted copy, a full disk), and bytes that are no checkpoint."""
    data = checkpoint.read_bytes()
    truncated, garbage = directory / "truncated.pt", directory / "garbage.pt"
    truncated.write_bytes(data[: len(data) * 9 // 10])
    garbage.write_bytes(bytes(range(256)) * 8)
    return {"truncated": truncated, "garbage": garbage}


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_checkpoint_is_named_in_one_error_line(toy_model, tmp_path, damage):
    """Torch's traceback named no file; fairseq-generate and fairseq-interactive now end
    with one error line naming it, exit status 2."""
    checkpoint = damaged_copies(toy_model.checkpoint, tmp_path)[damage]
    message = f"cannot load checkpoint {checkpoint}: the file is truncated, damaged or not a torch checkpoint"
    assert_one_error_line(generate(toy_model, checkpoint), "generate", message)
    lines = (toy_model.raw / "test.en").read_text().splitlines()[:2]
    assert_one_error_line(interactive(toy_model, lines, "--path", str(checkpoint)), "interactive", message)


def test_a_foreign_global_is_refused_in_one_error_line(toy_model, tmp_path):
    checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "foreign.pt", payload=fractions.Fraction(1, 3))
    assert_one_error_line(generate(toy_model, checkpoint), "generate", f"refusing to load {checkpoint}")


def test_train_restore_file_loads(toy_model, toy_spec, tmp_path):
    """fairseq-train --restore-file resumes the toy checkpoint for 3 more updates."""
    resumed = dataclasses.replace(toy_spec, max_update=toy_spec.max_update + 3)
    cmd = toy.fairseq_command("train") + [
        str(toy_model.data_bin), "--user-dir", toy.PLUGIN_DIR, "--save-dir", str(tmp_path), "--cpu",
        "--num-workers", "0", "--no-epoch-checkpoints", "--no-progress-bar", "--restore-file", str(toy_model.checkpoint),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    ] + resumed.train_args()
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert f"Loaded checkpoint {toy_model.checkpoint}" in log
    assert f"num_updates {resumed.max_update}" in log


def test_stock_fairseq_loads_checkpoints_without_installing_the_plugin(toy_model):
    """stock_fairseq.py loads checkpoint_safety.py by path: that module must import nothing of the package, or
    every stock side of a comparison silently runs with the plugin (its options, its kept batches)."""
    stock = toy.stock_fairseq_command("generate")
    help_text = subprocess.run(stock + ["--help"], capture_output=True, text=True).stdout
    assert "--beam" in help_text and "--decoder" not in help_text
    loaded = subprocess.run(stock + [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu",
                                     "--beam", "1", "--batch-size", "64", "--quiet"], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-2000:]


@pytest.mark.parametrize("problem", ["missing", "directory"])
def test_a_checkpoint_path_that_cannot_be_read_is_named_in_one_error_line(toy_model, tmp_path, problem):
    """A --path that does not exist ended fairseq-generate and fairseq-interactive with fairseq's
    OSError traceback ("Model file not found"); a directory with torch's."""
    checkpoint = tmp_path / "missing.pt" if problem == "missing" else tmp_path
    message = {"missing": f"checkpoint {checkpoint} does not exist",
               "directory": f"checkpoint {checkpoint} is a directory, not a checkpoint file"}[problem]
    assert_one_error_line(generate(toy_model, checkpoint), "generate", message)
    lines = (toy_model.raw / "test.en").read_text().splitlines()[:2]
    assert_one_error_line(interactive(toy_model, lines, "--path", str(checkpoint)), "interactive", message)


class Call:
    """Pickled as a call of ``function``: the checkpoint's pickle then references that global alone."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def advised_setting(stderr):
    found = re.search(rf"{TRUST_ENV}=(\S+) \(comma-separated", stderr)
    return found and found.group(1)


def test_the_refusals_advice_works_as_written(toy_model, tmp_path):
    """The refusal of a builtin advised FASTGEN_TRUSTED_GLOBALS=abs, which ended in a traceback
    (not of the form module.Name); a builtin by its bare name is allowed now."""
    checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "builtin.pt", payload=Call(abs, -1))
    refused = generate(toy_model, checkpoint)
    assert_one_error_line(refused, "generate", f"refusing to load {checkpoint}: its pickle references abs")
    assert advised_setting(refused.stderr) == "abs"
    trusted = generate(toy_model, checkpoint, env=dict(os.environ, **{TRUST_ENV: "abs"}))
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert "Translated 200 sentences" in trusted.stderr + trusted.stdout


def test_a_global_torch_never_loads_is_refused_without_advice(toy_model, tmp_path):
    """Following the advice FASTGEN_TRUSTED_GLOBALS=posix.system gave the same refusal: torch
    refuses every global of os, posix and sys, allowed or not."""
    checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "system.pt", payload=Call(os.system, "true"))
    refused = generate(toy_model, checkpoint)
    assert_one_error_line(refused, "generate", f"refusing to load {checkpoint}: its pickle references posix.system, "
                                               f"and torch never loads a global of module posix with weights_only")
    assert advised_setting(refused.stderr) is None
    trusted = generate(toy_model, checkpoint, env=dict(os.environ, **{TRUST_ENV: "posix.system"}))
    assert_one_error_line(trusted, "generate", f"{TRUST_ENV}=posix.system: posix.system is a global of module posix, "
                                               f"which torch never loads with weights_only, allowed or not")


def test_a_trusted_global_that_names_nothing_is_one_error_line(toy_model):
    """A misspelt entry ended every load, a clean checkpoint's too, in a traceback at import."""
    result = generate(toy_model, toy_model.checkpoint, env=dict(os.environ, **{TRUST_ENV: "nonexistent.Thing"}))
    assert_one_error_line(result, "generate", f"{TRUST_ENV}=nonexistent.Thing: nonexistent.Thing names no global "
                                              f"that can be imported (ModuleNotFoundError: ")
