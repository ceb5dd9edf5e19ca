"""A misuse of the plugin through the real fairseq-train / fairseq-generate / fairseq-interactive / fastgen-bench:
one ``error:`` line naming the problem, exit status 2, no traceback; the hub interface and task.build_generator
raise the plugin's UsageError."""

import dataclasses
import re
import subprocess

import pytest

from fairseq_fastgen.option_checks import UsageError
from fastgen_demo import toy
from tests.bench.test_bench_cli import bench_command
from tests.test_foundation_cli import generate, interactive

pytestmark = pytest.mark.xdist_group("test_usage_errors")

MISUSES = {
    "decoder vs options": (["--decoder", "greedy", "--nbest", "2"],
                           "--decoder greedy produces one hypothesis per sentence; got --nbest 2"),
    "decoder vs model": (["--decoder", "blockwise", "--beam", "1"], "--decoder blockwise needs a k-head model"),
    "engine": (["--decoder", "greedy", "--beam", "1", "--step-engine", "fairseq", "--compiled-freezing"],
               "--compiled-freezing applies to --step-engine compiled"),
    "engine background": (["--decoder", "greedy", "--beam", "1", "--step-engine", "static",
                           "--compile-in-background"],
                          "--compile-in-background applies to --step-engine compiled; got --step-engine static"),
    "engine many rows": (["--decoder", "greedy", "--beam", "1", "--step-engine", "static", "--compiled-many-rows",
                          "unit"], "--compiled-many-rows applies to --step-engine compiled; got --step-engine static"),
    "streaming option": (["--decoder", "var-stream", "--beam", "4", "--stream-eps", "2"], "--stream-eps"),
    # 0 was read as "every head"; refused before the model loads, whatever the model
    "block size 0": (["--decoder", "blockwise", "--beam", "1", "--blockwise-block-size", "0"],
                     "--blockwise-block-size must be an integer >= 1, got 0"),
    "cluster file": (["--decoder", "greedy", "--beam", "1", "--cluster-projection", "/nonexistent/clusters.pt"],
                     "/nonexistent/clusters.pt"),
    "screened projection": (["--decoder", "greedy", "--beam", "1", "--screened-projection",
                             "--no-repeat-ngram-size", "2"], "--no-repeat-ngram-size bans tokens"),
    # fairseq's search ended in a RuntimeError traceback
    "beam 0": (["--decoder", "beam", "--beam", "0"], "--beam must be an integer >= 1, got 0"),
}


def assert_one_error_line(result, tool, message):
    """``tool``: generate or interactive (the program fairseq-TOOL), or a program's whole name."""
    program = tool if "-" in tool else f"fairseq-{tool}"
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"{program}: error:")]
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


TRAIN_MISUSES = {
    # each ended fairseq-train in a ValueError traceback from the model, criterion or task
    "k-head layer width 0": (["--arch", "transformer_khead", "--khead-ffn-dim", "0"],
                             "--khead-ffn-dim must be >= 1, got 0"),
    "block size 0": (["--arch", "transformer_khead", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    "criterion without k heads": (["--arch", "transformer", "--criterion", "random_subloss"],
                                  "--criterion random_subloss needs a k-head model"),
    "distilled mix without data": (["--arch", "transformer", "--task", "translation_distill"],
                                   "--distill-mix distilled needs --distilled-data"),
}


@pytest.mark.parametrize("misuse", list(TRAIN_MISUSES))
def test_fairseq_train_refuses_a_misuse_in_one_line(toy_model, tmp_path, misuse):
    options, message = TRAIN_MISUSES[misuse]
    command = toy.fairseq_command("train") + [
        str(toy_model.data_bin), "--user-dir", toy.PLUGIN_DIR, "--save-dir", str(tmp_path), "--cpu",
        "--num-workers", "0", "--max-update", "1", "--max-tokens", "500", "--optimizer", "adam",
        "--encoder-layers", "1", "--decoder-layers", "1", "--no-progress-bar", *options,
    ]
    assert_one_error_line(subprocess.run(command, capture_output=True, text=True), "fairseq-train", message)
    assert not list(tmp_path.glob("checkpoint*.pt"))  # refused before any update is saved


def test_an_unwritable_stats_json_is_refused_before_decoding(toy_model, tmp_path):
    """The file was opened after the whole decode (a traceback, the statistics lost)."""
    stats = tmp_path / "missing" / "stats.json"
    result = generate(toy_model, "--decoder", "greedy", "--beam", "1", "--decoder-stats-json", str(stats))
    assert_one_error_line(result, "generate", f"--decoder-stats-json {stats} cannot be written: No such file or "
                                              f"directory")
    assert not re.search("^[SH]-", result.stdout, re.M)  # refused before any sentence is decoded


def test_a_data_bin_without_its_dictionary_is_one_error_line(toy_model, tmp_path):
    """Fairseq's FileNotFoundError traceback; the file is named in one line."""
    data_bin = tmp_path / "bin"
    data_bin.mkdir()
    for path in toy_model.data_bin.iterdir():
        if path.name != "dict.en.txt":
            (data_bin / path.name).symlink_to(path)
    result = generate(dataclasses.replace(toy_model, data_bin=data_bin), "--decoder", "greedy", "--beam", "1")
    assert_one_error_line(result, "generate", f"dictionary {data_bin / 'dict.en.txt'} does not exist")


def test_build_generator_raises_the_plugins_usage_error(toy_model):
    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import GenerationConfig

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy_model.checkpoint)], arg_overrides={"data": str(toy_model.data_bin)}
    )
    with pytest.raises(UsageError, match="--decoder blockwise needs a k-head model"):
        task.build_generator(models, GenerationConfig(decoder="blockwise", beam=1))


# fastgen-bench made each of these a 'skipped' row (or a traceback) and went on benchmarking the rest
BENCH_MISUSES = {
    "decoder vs options": (["--decoders", "greedy", "--nbest", "2"], MISUSES["decoder vs options"][1]),
    "decoder vs model": (["--decoders", "greedy,blockwise"], MISUSES["decoder vs model"][1]),
    "engine": (["--decoders", "greedy", "--step-engine", "fairseq", "--compiled-freezing"], MISUSES["engine"][1]),
    "streaming option": (["--decoders", "var-stream", "--beam", "4", "--stream-eps", "2"], "--stream-eps"),
    "cluster file": (["--decoders", "greedy", "--cluster-projection", "/nonexistent/clusters.pt"],
                     "/nonexistent/clusters.pt"),
    "a variant's cluster file, whole processes": (
        ["--decoders", "beam", "--whole-process", "--variant", "bad=--cluster-projection /nonexistent/clusters.pt"],
        "/nonexistent/clusters.pt"),
    "checkpoint": (["--decoders", "greedy", "--path", "/nonexistent/model.pt"],
                   "checkpoint /nonexistent/model.pt does not exist"),
    "k-head checkpoint": (["--decoders", "blockwise", "--khead-path", "/nonexistent/khead.pt"],
                          "checkpoint /nonexistent/khead.pt does not exist"),
}


@pytest.mark.parametrize("misuse", list(BENCH_MISUSES))
def test_fastgen_bench_refuses_a_misuse_in_one_line_before_any_pass(toy_model, tmp_path, misuse):
    options, message = BENCH_MISUSES[misuse]
    output_dir = tmp_path / "out"
    command = bench_command() + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1", "--beam", "1",
        "--batch-size", "8", "--repeat", "1", "--no-ctranslate2", "--no-progress-bar", "--output-dir", str(output_dir),
    ] + options
    result = subprocess.run(command, capture_output=True, text=True)
    assert_one_error_line(result, "fastgen-bench", message)
    assert "skipped" not in result.stderr and not output_dir.exists()
