"""The real commands on the multilingual toy model (en-fr and de-fr, one transformer):
fastgen-train-clusters writes a directory per scope (atomically), and fairseq-generate
--cluster-projection DIR takes the run's file or refuses in one error line."""

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ModelFingerprint
from fairseq_fastgen.cluster.directory import INDEX_NAME, write_directory
from fairseq_fastgen.safe_files import KILL_AT_WRITE_STEP_ENV
from fastgen_demo import toy as toy_pipeline
from tests.cluster.conftest import MULTILINGUAL_SIZES, full_coverage_file
from tests.cluster.test_cluster_cli import projection_statistics
from tests.test_usage_errors import assert_one_error_line

pytestmark = pytest.mark.xdist_group("test_multilingual_cli")

CLUSTERS, TOP_K, STATES = 8, 2, 1500  # STATES per direction


def train_clusters(command, toy, output, *extra, env=None):
    """fastgen-train-clusters on ``toy`` (a model fixture): the completed process."""
    return subprocess.run(command + [
        str(toy.data_bin), "--path", str(toy.checkpoint), "--split", "train", "--num-clusters", str(CLUSTERS),
        "--top-k", str(TOP_K), "--max-states", str(STATES), "--output", str(output), "--cpu", *extra,
    ], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def cluster_dir(multilingual_toy_model, train_clusters_command, tmp_path_factory):
    """One directory, written by a run per scope: its path and the two runs' output."""
    directory = tmp_path_factory.mktemp("multilingual") / "clusters"
    runs = [train_clusters(train_clusters_command, multilingual_toy_model, directory, "--cluster-scope", scope)
            for scope in ("direction", "target")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return SimpleNamespace(path=directory, output=[run.stdout + run.stderr for run in runs])


def generate(toy, direction, decoder, *extra):
    """fairseq-generate on the multilingual toy's test split in ``direction``."""
    source_lang, target_lang = direction.split("-")
    return subprocess.run(toy_pipeline.fairseq_command("generate") + [
        str(toy.data_bin), "--path", str(toy.checkpoint), "--user-dir", toy_pipeline.PLUGIN_DIR, "--cpu",
        *toy.task_args, "--source-lang", source_lang, "--target-lang", target_lang, "--gen-subset", "test",
        "--batch-size", "16", "--beam", "1" if decoder == "greedy" else "4", "--decoder", decoder, *extra,
    ], capture_output=True, text=True)


def hypotheses(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return sorted(line for line in result.stdout.splitlines() if re.match(r"^[HP]-\d+\t", line))


def test_train_clusters_writes_a_file_per_direction_and_per_target(multilingual, cluster_dir):
    index = json.loads((cluster_dir.path / INDEX_NAME).read_text())
    assert index["files"] == {
        "direction.en-fr.pt": {"scope": "direction", "source_lang": "en", "target_lang": "fr"},
        "direction.de-fr.pt": {"scope": "direction", "source_lang": "de", "target_lang": "fr"},
        "target.fr.pt": {"scope": "target", "source_lang": None, "target_lang": "fr"},
    }
    fingerprint = ModelFingerprint.of_decoder(multilingual.model.decoder)
    assert index["model"] == fingerprint.__dict__
    dictionary = multilingual.task.target_dictionary
    kept = {dictionary.bos(), dictionary.eos(), dictionary.unk(), dictionary.index("__fr__")}
    expected = [("direction.en-fr.pt", STATES, ["en-fr"]), ("direction.de-fr.pt", STATES, ["de-fr"]),
                ("target.fr.pt", 2 * STATES, ["en-fr", "de-fr"])]
    for name, states, directions in expected:
        cluster_file = ClusterFile.load(cluster_dir.path / name)
        assert cluster_file.fingerprint == fingerprint
        assert (cluster_file.num_clusters, cluster_file.top_k, cluster_file.states) == (CLUSTERS, TOP_K, states), name
        assert cluster_file.training["directions"] == directions
        for cluster in range(CLUSTERS):
            tokens = set(cluster_file.cluster_tokens(cluster).tolist())
            assert kept <= tokens and dictionary.pad() not in tokens, (name, cluster)
        assert cluster_file.tokens.numel() < CLUSTERS * len(dictionary)
    assert f"wrote {cluster_dir.path / 'direction.de-fr.pt'} (direction de-fr)" in cluster_dir.output[0]
    assert f"wrote {cluster_dir.path / 'target.fr.pt'} (target language fr (any source))" in cluster_dir.output[1]
    assert not list(cluster_dir.path.glob(".*"))  # no temporary file left


def test_generate_takes_the_run_direction_file_else_the_target_file(multilingual_toy_model, cluster_dir, tmp_path):
    result = generate(multilingual_toy_model, "en-fr", "beam", "--cluster-projection", str(cluster_dir.path))
    hypotheses(result)
    chosen = cluster_dir.path / "direction.en-fr.pt"
    assert f"--cluster-projection: {chosen}, the clusters of direction en-fr" in result.stderr
    stats = projection_statistics(result.stdout)
    assert 0 < stats["projection_active_fraction_mean"] <= stats["projection_active_fraction_max"] < 1
    target_only = tmp_path / "target-only"
    write_directory(target_only, [ClusterFile.load(cluster_dir.path / "target.fr.pt")])
    result = generate(multilingual_toy_model, "de-fr", "greedy", "--cluster-projection", str(target_only))
    hypotheses(result)
    assert f"--cluster-projection: {target_only / 'target.fr.pt'}, the clusters of target language fr" in result.stderr
    assert projection_statistics(result.stdout)["projection_active_fraction_max"] < 1


@pytest.mark.parametrize("direction, decoder, scope", [("en-fr", "beam", "target"), ("de-fr", "greedy", "direction")])
def test_whole_vocabulary_directory_gives_identical_output(multilingual, multilingual_toy_model, tmp_path, direction,
                                                           decoder, scope):
    source_lang, target_lang = direction.split("-")
    languages = {"source_lang": source_lang if scope == "direction" else None, "target_lang": target_lang}
    write_directory(tmp_path, [full_coverage_file(multilingual.model, scope=scope, **languages)])
    plain = hypotheses(generate(multilingual_toy_model, direction, decoder))
    result = generate(multilingual_toy_model, direction, decoder, "--cluster-projection", str(tmp_path))
    assert hypotheses(result) == plain and len(plain) == 2 * MULTILINGUAL_SIZES["n_test"]  # an H and a P line each
    assert not any("__fr__" in line for line in plain)  # the language token is stripped by every decoder
    assert projection_statistics(result.stdout)["projection_active_fraction_mean"] == 1.0


def test_refusals_name_the_problem_in_one_error_line(multilingual, multilingual_toy_model, toy, tmp_path):
    only_en = tmp_path / "only-en"
    write_directory(only_en, [full_coverage_file(multilingual.model, scope="direction", source_lang="en",
                                                 target_lang="fr")])
    result = generate(multilingual_toy_model, "de-fr", "greedy", "--cluster-projection", str(only_en))
    assert_one_error_line(result, "generate", f"--cluster-projection {only_en} has no cluster file for de-fr; "
                                              f"it has en-fr")
    other_scope = tmp_path / "other-scope"  # a target file where the index names a direction file
    shutil.copytree(only_en, other_scope)
    full_coverage_file(multilingual.model, scope="target", target_lang="fr").save(other_scope / "direction.en-fr.pt")
    result = generate(multilingual_toy_model, "en-fr", "beam", "--cluster-projection", str(other_scope))
    assert_one_error_line(result, "generate", "(scope target), but index.json lists it as scope direction en-fr")
    other_model = tmp_path / "other-model"  # the bilingual toy model's directory
    write_directory(other_model, [full_coverage_file(toy.model, scope="direction", source_lang="en",
                                                     target_lang="fr")])
    result = generate(multilingual_toy_model, "en-fr", "greedy", "--cluster-projection", str(other_model))
    assert_one_error_line(result, "generate", "direction.en-fr.pt was made for another model (vocab_size")


def test_a_killed_run_leaves_no_partial_file_and_a_rerun_completes(multilingual_toy_model, train_clusters_command,
                                                                   tmp_path):
    """Write steps of a direction run: each file's temporary written (1, 3), renamed (2, 4); the index (5, 6).
    Killed at 5, both files are whole and no index names them yet."""
    output = tmp_path / "clusters"
    killed = train_clusters(train_clusters_command, multilingual_toy_model, output,
                            env={**os.environ, KILL_AT_WRITE_STEP_ENV: "5"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "write step 5: index.json written to its temporary file" in killed.stderr
    assert sorted(p.name for p in output.iterdir() if not p.name.startswith(".")) == [
        "direction.de-fr.pt", "direction.en-fr.pt"]
    for name in ("direction.de-fr.pt", "direction.en-fr.pt"):
        ClusterFile.load(output / name)  # whole
    assert [p.name.startswith(f".{INDEX_NAME}.") for p in output.glob(".*.tmp")] == [True]  # the index's temporary
    rerun = train_clusters(train_clusters_command, multilingual_toy_model, output)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert sorted(p.name for p in output.iterdir()) == ["direction.de-fr.pt", "direction.en-fr.pt", INDEX_NAME]


def test_a_killed_save_keeps_the_previous_single_file(tmp_path):
    """The bilingual file: a save killed before its rename leaves the previous file whole."""
    path = tmp_path / "clusters.pt"
    script = ("import sys, torch; from fairseq_fastgen.cluster.clusterfile import ClusterFile, ModelFingerprint; "
              "ClusterFile.build(torch.full((2, 3), float(sys.argv[2])), [[0, 1], [2]], ModelFingerprint(4, 3, 'ab'), "
              "top_k=1, states=0).save(sys.argv[1])")
    subprocess.run([sys.executable, "-c", script, str(path), "1"], check=True)
    killed = subprocess.run([sys.executable, "-c", script, str(path), "2"], capture_output=True, text=True,
                            env={**os.environ, KILL_AT_WRITE_STEP_ENV: "1"})
    assert killed.returncode == -9 and "clusters.pt written to its temporary file" in killed.stderr
    assert torch.equal(ClusterFile.load(path).centroids, torch.ones(2, 3))


def test_bilingual_model_writes_a_directory_when_output_is_one(toy_model, train_clusters_command, tmp_path):
    result = train_clusters(train_clusters_command, toy_model, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / INDEX_NAME).read_text())["files"] == {
        "direction.en-fr.pt": {"scope": "direction", "source_lang": "en", "target_lang": "fr"}}
