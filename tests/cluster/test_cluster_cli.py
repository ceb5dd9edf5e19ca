"""The real commands: fastgen-train-clusters, then fairseq-generate --cluster-projection."""

import fractions
import random
import re
import subprocess

import pytest

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, ModelFingerprint
from fairseq_fastgen.cluster.train import ClusterTrainingConfig, check_counts, cli_main
from fastgen_demo import toy as toy_pipeline
from tests.test_checkpoint_safety import damaged_copies, rewrite_checkpoint
from tests.test_usage_errors import assert_one_error_line


def sentences_in(small_test_bin):
    return len((small_test_bin.parent / f"test.{toy_pipeline.SRC}").read_text().splitlines())


def generate(toy_model, data_bin, plugin_dir, decoder, *extra):
    """fairseq-generate on the test split of ``data_bin``: (H and P lines sorted, full output)."""
    output = toy_pipeline.run(toy_pipeline.fairseq_command("generate") + [
        str(data_bin), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
        "--gen-subset", "test", "--batch-size", "8",
        "--beam", "1" if decoder == "greedy" else "4", "--decoder", decoder, *extra,
    ])
    lines = sorted(line for line in output.splitlines() if re.match(r"^[HP]-\d+\t", line))
    return lines, output


def projection_statistics(output):
    return {name: float(value) for name, value in re.findall(r"(projection_\w+)=([\d.]+)", output)}


def test_train_clusters_writes_a_file_for_the_model(toy, trained_cluster_run):
    run = trained_cluster_run
    cluster_file = ClusterFile.load(run.path)
    dictionary = toy.task.target_dictionary
    assert cluster_file.fingerprint == ModelFingerprint.of_decoder(toy.model.decoder)
    assert (cluster_file.num_clusters, cluster_file.top_k, cluster_file.states) == (run.clusters, run.top_k, run.states)
    assert (cluster_file.scope, cluster_file.source_lang, cluster_file.target_lang) == ("direction", "en", "fr")
    for cluster in range(cluster_file.num_clusters):
        tokens = cluster_file.cluster_tokens(cluster).tolist()
        assert tokens == sorted(set(tokens))
        assert {dictionary.bos(), dictionary.eos(), dictionary.unk()} <= set(tokens)
        assert dictionary.pad() not in tokens
        assert len(tokens) >= run.top_k  # at least one member's (or the nearest state's) top-K
    assert cluster_file.tokens.numel() < run.clusters * len(dictionary)  # sets really are subsets
    assert "decoder states" in run.output and f"wrote {run.path}" in run.output


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_whole_vocabulary_file_gives_identical_output(toy_model, small_test_bin, plugin_dir, full_coverage_path,
                                                      decoder):
    plain, _ = generate(toy_model, small_test_bin, plugin_dir, decoder)
    projected, output = generate(toy_model, small_test_bin, plugin_dir, decoder,
                                 "--cluster-projection", str(full_coverage_path))
    assert len(plain) == 2 * sentences_in(small_test_bin)  # an H and a P line per sentence
    assert projected == plain
    stats = projection_statistics(output)
    assert stats["projection_steps"] > 0 and stats["projection_active_fraction_mean"] == 1.0


def test_trained_file_decodes_with_fairseq_beam_search(toy_model, small_test_bin, plugin_dir, trained_cluster_path):
    """(The plugin's decoders decode with a trained file in test_cluster_decoding.py.)"""
    lines, output = generate(toy_model, small_test_bin, plugin_dir, "beam",
                             "--cluster-projection", str(trained_cluster_path))
    assert len([line for line in lines if line.startswith("H-")]) == sentences_in(small_test_bin)
    stats = projection_statistics(output)
    assert 0 < stats["projection_active_fraction_mean"] <= stats["projection_active_fraction_max"] < 1


def config(**overrides):
    return ClusterTrainingConfig(**{"data": "bin", "path": "model.pt", "output": "out.pt", **overrides})


@pytest.mark.parametrize("overrides, vocab_size, message", [
    (dict(num_clusters=0), None, "--num-clusters must be at least 1"),
    (dict(num_clusters=100, max_states=50), None, "--max-states 50 is below --num-clusters 100"),
    (dict(top_k=0), None, "--top-k must be between 1"),
    (dict(top_k=11), 10, "--top-k must be between 1 and the vocabulary size 10"),
    (dict(iterations=0), None, "--iterations must be at least 1"),
    (dict(max_tokens=0), None, "--max-tokens must be an integer >= 1, got 0"),
    (dict(batch_size=-4), None, "--batch-size must be an integer >= 1, got -4"),
    (dict(seed=-1), None, "--seed must be an integer in [0, 2147483647], got -1"),
    (dict(seed=2**31), None, "--seed must be an integer in [0, 2147483647], got 2147483648"),
])
def test_settings_that_make_no_sense_are_refused(overrides, vocab_size, message):
    with pytest.raises(ClusterFileError, match=re.escape(message)):
        check_counts(config(**overrides), vocab_size)


def test_more_clusters_than_states_is_refused_by_the_command(toy_model, tmp_path, capsys):
    output = tmp_path / "clusters.pt"
    with pytest.raises(SystemExit) as exit_info:  # in this process: the model loads faster than a new one starts
        cli_main([str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--split", "valid", "--cpu",
                  "--num-clusters", "100000", "--max-states", "200000", "--output", str(output)])
    assert exit_info.value.code == 2
    assert re.search(r"^fastgen-train-clusters: error: --num-clusters 100000 exceeds the \d+ decoder states of split "
                     r"'valid'", capsys.readouterr().err, re.M)
    assert not output.exists()


@pytest.mark.parametrize("problem", ["truncated", "untrusted"])
def test_a_checkpoint_that_is_not_loaded_is_one_error_line(toy_model, train_clusters_command, tmp_path, problem):
    """Fastgen-train-clusters answered a truncated or untrusted checkpoint with a traceback (exit
    status 1) where every other tool gives one error line and exit status 2."""
    if problem == "truncated":
        checkpoint = damaged_copies(toy_model.checkpoint, tmp_path)["truncated"]
        message = f"cannot load checkpoint {checkpoint}: the file is truncated, damaged or not a torch checkpoint"
    else:
        checkpoint = rewrite_checkpoint(toy_model.checkpoint, tmp_path / "foreign.pt", payload=fractions.Fraction(1))
        message = f"refusing to load {checkpoint}: its pickle references fractions.Fraction"
    output = tmp_path / "clusters.pt"
    result = subprocess.run(train_clusters_command + [str(toy_model.data_bin), "--path", str(checkpoint), "--cpu",
                                                      "--output", str(output)], capture_output=True, text=True)
    assert_one_error_line(result, "fastgen-train-clusters", message)
    assert not output.exists()


def test_settings_in_range_pass():
    check_counts(config(max_tokens=None, batch_size=1, seed=0))
    check_counts(config(max_tokens=1, seed=2**31 - 1))


def test_a_random_bytes_cluster_file_is_one_error_line(toy_model, tmp_path):
    """Torch's paragraphs advising weights_only=False, where a checkpoint gets one line."""
    path = tmp_path / "clusters.pt"
    path.write_bytes(random.Random(8).randbytes(4096))
    result = subprocess.run(toy_pipeline.fairseq_command("generate") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--user-dir", toy_pipeline.PLUGIN_DIR, "--cpu",
        "--decoder", "greedy", "--beam", "1", "--cluster-projection", str(path)], capture_output=True, text=True)
    assert_one_error_line(result, "generate", f"cannot read cluster file {path}: the file is truncated, damaged or "
                                              f"not a cluster file (")
    assert "weights_only" not in result.stderr and not re.search("^[SH]-", result.stdout, re.M)
