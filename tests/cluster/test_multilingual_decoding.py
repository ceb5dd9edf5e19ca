"""--cluster-projection DIR on a multilingual model (en-fr and de-fr in one transformer), in this process.

A directory of whole-vocabulary files, of either scope, must leave every decoder's
output unchanged in each direction, with the run's own file chosen; a directory
holding both scopes gives a direction its own file before its target language's;
a direction without a file, a file of another direction, target language or scope,
and a directory of another model are refused, naming what they hold.
(The real commands: test_multilingual_cli.py.)
"""

import copy

import pytest

from fairseq_fastgen.cluster.clusterfile import ClusterFileError
from fairseq_fastgen.cluster.directory import INDEX_NAME, write_directory
from fairseq_fastgen.cluster.projection import load_projection
from fairseq_fastgen.sequence_generators import DECODERS
from tests.cluster.conftest import full_coverage_file
from tests.cluster.test_cluster_decoding import (
    K_HEAD_DECODERS, PLAIN_DECODERS, assert_unchanged_by_projection, build,
)

DIRECTIONS = ("en-fr", "de-fr")
DIRECTION_CLUSTERS, TARGET_CLUSTERS = 3, 5  # tell the chosen file apart


@pytest.fixture(scope="module")
def model(multilingual):
    """A private copy: decoding may attach a projection to its decoder."""
    return copy.deepcopy(multilingual.model)


def direction_file(model, direction, clusters=DIRECTION_CLUSTERS):
    source_lang, target_lang = direction.split("-")
    return full_coverage_file(model, clusters, scope="direction", source_lang=source_lang, target_lang=target_lang)


def target_file(model, target_lang="fr", clusters=TARGET_CLUSTERS):
    return full_coverage_file(model, clusters, seed=1, scope="target", target_lang=target_lang)


@pytest.fixture(scope="module")
def whole_vocabulary_dirs(model, tmp_path_factory):
    """scope -> a directory of whole-vocabulary files of that scope only."""
    root = tmp_path_factory.mktemp("multilingual")
    write_directory(root / "direction", [direction_file(model, d) for d in DIRECTIONS])
    write_directory(root / "target", [target_file(model)])
    return {"direction": root / "direction", "target": root / "target"}


def projection_of(generator):
    runner = getattr(generator, "runner", None)
    return getattr(runner, "projection", None) or getattr(generator, "projection", None)


@pytest.mark.parametrize("scope", ["direction", "target"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("decoder", PLAIN_DECODERS)
def test_whole_vocabulary_directory_changes_nothing(multilingual, model, whole_vocabulary_dirs, decoder, direction,
                                                    scope):
    if decoder not in DECODERS:
        pytest.skip(f"--decoder {decoder} is not registered (yet)")
    task = multilingual.directions[direction]
    projection = assert_unchanged_by_projection(task, model, decoder, 1 if decoder == "greedy" else 4,
                                                cluster_projection=str(whole_vocabulary_dirs[scope]))
    chosen = projection.cluster_file
    assert (chosen.scope, chosen.target_lang) == (scope, "fr")
    assert chosen.source_lang == (direction.split("-")[0] if scope == "direction" else None)


@pytest.mark.parametrize("decoder", sorted(K_HEAD_DECODERS))
def test_blockwise_decoders_take_the_file_of_their_direction_from_a_directory(khead, tmp_path, decoder):
    """The k-head decoders need a transformer_khead model; none is trained on the multilingual toy,
    so they read a directory for the bilingual k-head model (en-fr), whose task names its direction."""
    if decoder not in DECODERS:
        pytest.skip(f"--decoder {decoder} is not registered (yet)")
    khead_model = copy.deepcopy(khead.model)
    write_directory(tmp_path, [direction_file(khead_model, "fr-en", clusters=2), direction_file(khead_model, "en-fr")])
    projection = assert_unchanged_by_projection(khead.task, khead_model, decoder, 1, cluster_projection=str(tmp_path))
    assert (projection.cluster_file.source_lang, projection.cluster_file.num_clusters) == ("en", DIRECTION_CLUSTERS)


@pytest.mark.parametrize("decoder", ["beam", "greedy", "var-batch"])
def test_direction_file_is_chosen_over_the_target_file(multilingual, model, tmp_path, decoder):
    write_directory(tmp_path, [direction_file(model, "en-fr")])  # as fastgen-train-clusters run once per scope
    write_directory(tmp_path, [target_file(model)])
    expected = [("en-fr", "direction", DIRECTION_CLUSTERS), ("de-fr", "target", TARGET_CLUSTERS)]
    for direction, scope, clusters in expected:
        generator = build(multilingual.directions[direction], model, decoder, 2, cluster_projection=str(tmp_path))
        chosen = projection_of(generator).cluster_file
        assert (chosen.scope, chosen.num_clusters) == (scope, clusters), direction


def refusal(multilingual, model, direction, path, decoder="greedy"):
    with pytest.raises(ClusterFileError) as refused:
        build(multilingual.directions[direction], model, decoder, 1, cluster_projection=str(path))
    return str(refused.value)


@pytest.mark.parametrize("decoder", ["beam", "greedy"])
def test_direction_without_a_file_is_refused_naming_those_it_has(multilingual, model, tmp_path, decoder):
    write_directory(tmp_path, [direction_file(model, "en-fr"), target_file(model, "de")])
    message = refusal(multilingual, model, "de-fr", tmp_path, decoder)
    assert message == (f"--cluster-projection {tmp_path} has no cluster file for de-fr; "
                       f"it has en-fr, *-de (scope target)")


def test_file_of_another_direction_or_target_language_is_refused(multilingual, model, tmp_path):
    write_directory(tmp_path, [direction_file(model, "en-fr"), target_file(model, "de")])
    assert "holds the clusters of direction en-fr; this run translates de-fr" in refusal(
        multilingual, model, "de-fr", tmp_path / "direction.en-fr.pt")
    assert "holds the clusters of target language de (any source); this run translates en-fr" in refusal(
        multilingual, model, "en-fr", tmp_path / "target.de.pt")


def test_file_whose_scope_is_not_the_one_its_index_names_is_refused(multilingual, model, tmp_path):
    write_directory(tmp_path, [direction_file(model, "en-fr")])
    target_file(model).save(tmp_path / "direction.en-fr.pt")  # a target file under the direction file's name
    message = refusal(multilingual, model, "en-fr", tmp_path)
    assert "holds the clusters of target language fr (any source) (scope target), but index.json lists it as " \
           "scope direction en-fr" in message


def test_directory_of_another_model_is_refused(multilingual, model, toy, tmp_path):
    write_directory(tmp_path, [direction_file(toy.model, "en-fr")])  # the bilingual toy model's
    assert "was made for another model (vocab_size" in refusal(multilingual, model, "en-fr", tmp_path)


def test_directory_without_index_or_run_without_languages_is_refused(multilingual, model, tmp_path):
    write_directory(tmp_path, [direction_file(model, "en-fr")])
    with pytest.raises(ClusterFileError, match="this run names no --source-lang and --target-lang"):
        load_projection(tmp_path, model, direction=None)  # a task without languages (fairseq's multilingual
        # task builds no generator without them)
    (tmp_path / INDEX_NAME).unlink()
    assert f"has no {INDEX_NAME}" in refusal(multilingual, model, "en-fr", tmp_path)


def test_writing_into_a_directory_of_another_model_is_refused(model, toy, tmp_path):
    write_directory(tmp_path, [direction_file(toy.model, "en-fr")])
    with pytest.raises(ClusterFileError, match="holds the cluster files of another model"):
        write_directory(tmp_path, [direction_file(model, "en-fr")])


def test_plugin_decoders_leave_the_language_token_out_of_the_output(multilingual, model):
    """fairseq's multilingual task asks its generator to strip the forced target language token."""
    task = multilingual.directions["de-fr"]
    language_token = task.target_dictionary.index("__fr__")
    for decoder in ("beam", "greedy", "var-batch"):
        generator = build(task, model, decoder, 2)
        assert language_token in generator.symbols_to_strip_from_output, decoder
