"""The cluster file round-trips; corrupted, truncated, inconsistent and
other-model files are refused with a message saying why."""

import copy

import pytest
import torch

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, ModelFingerprint, _checksum
from fairseq_fastgen.cluster.projection import load_projection

FINGERPRINT = ModelFingerprint(vocab_size=10, hidden_size=3, projection_sha256="ab" * 32)


def small_file(**overrides) -> ClusterFile:
    fields = dict(
        centroids=torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]]),
        token_lists_or_csr=[[2, 7, 3], [2, 9]],
        fingerprint=FINGERPRINT, top_k=2, states=50, source_lang="en", target_lang="fr",
        training={"split": "train", "seed": 1},
    )
    fields.update(overrides)
    return ClusterFile.build(**fields)


def test_round_trip(tmp_path):
    path = tmp_path / "clusters.pt"
    original = small_file()
    original.save(path)
    loaded = ClusterFile.load(path)
    for name in ("centroids", "centroid_sqnorms", "offsets", "tokens"):
        assert torch.equal(getattr(loaded, name), getattr(original, name)), name
    assert loaded.offsets.tolist() == [0, 3, 5]
    assert loaded.tokens.tolist() == [2, 3, 7, 2, 9]  # each set sorted
    assert loaded.centroid_sqnorms.tolist() == [5.0, 10.25]
    assert loaded.fingerprint == FINGERPRINT
    assert (loaded.top_k, loaded.states, loaded.source_lang, loaded.target_lang) == (2, 50, "en", "fr")
    assert loaded.training == {"split": "train", "seed": 1}
    assert not (tmp_path / "clusters.pt.tmp").exists()


def test_the_outside_mass_estimate_round_trips_and_a_file_without_it_still_loads(tmp_path):
    estimate = dict(outside_intercepts=torch.tensor([1.5, -2.0]), outside_gradients=torch.arange(6.0).view(2, 3))
    small_file(**estimate).save(tmp_path / "estimate.pt")
    loaded = ClusterFile.load(tmp_path / "estimate.pt")
    assert loaded.has_outside_estimate
    for name, tensor in estimate.items():
        assert torch.equal(getattr(loaded, name), tensor), name
    small_file().save(tmp_path / "plain.pt")  # as files made before the estimate
    assert not ClusterFile.load(tmp_path / "plain.pt").has_outside_estimate
    payload = torch.load(tmp_path / "estimate.pt", weights_only=True)
    payload["tensors"]["outside_gradients"][1, 2] += 1.0  # the estimate is under the checksum too
    torch.save(payload, tmp_path / "edited.pt")
    with pytest.raises(ClusterFileError, match="checksum"):
        ClusterFile.load(tmp_path / "edited.pt")


@pytest.mark.parametrize("estimate, message", [
    (dict(outside_intercepts=torch.zeros(2)), "must hold \\(2,\\) intercepts and \\(2, 3\\) gradients"),
    (dict(outside_intercepts=torch.zeros(3), outside_gradients=torch.zeros(2, 3)), "must hold"),
    (dict(outside_intercepts=torch.zeros(2), outside_gradients=torch.full((2, 3), float("inf"))), "inf or nan"),
])
def test_an_inconsistent_estimate_is_refused(tmp_path, estimate, message):
    with pytest.raises(ClusterFileError, match=message):
        small_file(**estimate).save(tmp_path / "clusters.pt")


def test_corrupted_tensor_bytes_are_refused(tmp_path):
    path = tmp_path / "clusters.pt"
    small_file().save(path)
    data = bytearray(path.read_bytes())
    original_centroid_bytes = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]]).numpy().tobytes()
    at = bytes(data).index(original_centroid_bytes)  # torch.save stores tensor data uncompressed
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ClusterFileError, match="checksum"):
        ClusterFile.load(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_truncated_file_is_refused(tmp_path, keep):
    path = tmp_path / "clusters.pt"
    small_file().save(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ClusterFileError, match="truncated, damaged or not a cluster file"):
        ClusterFile.load(path)


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(ClusterFileError, match="does not exist"):
        ClusterFile.load(tmp_path / "absent.pt")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(ClusterFileError, match="not a cluster file"):
        ClusterFile.load(foreign)


def test_other_format_version_is_refused(tmp_path):
    path = tmp_path / "clusters.pt"
    small_file().save(path)
    payload = torch.load(path, weights_only=True)
    payload["metadata"]["version"] = 99
    torch.save(payload, path)
    with pytest.raises(ClusterFileError, match="version 99"):
        ClusterFile.load(path)


@pytest.mark.parametrize("overrides, message", [
    (dict(token_lists_or_csr=[[2, 7], []]), "empty active set"),
    (dict(token_lists_or_csr=[[2, 10], [2]]), "outside the vocabulary"),
    (dict(top_k=0), "top_k 0"),
    (dict(top_k=11), "top_k 11"),
    (dict(states=1), "2 clusters from only 1 states"),
    (dict(centroids=torch.zeros(2, 4)), "expected \\(clusters >= 1, 3\\)"),
    (dict(centroids=torch.tensor([[0.0, 1.0, float("nan")], [0.0, 0.0, 0.0]])), "inf or nan"),
])
def test_inconsistent_contents_are_refused(tmp_path, overrides, message):
    with pytest.raises(ClusterFileError, match=message):
        small_file(**overrides).save(tmp_path / "clusters.pt")


def test_inconsistent_offsets_are_refused_on_save_and_load(tmp_path):
    inconsistent = small_file()
    inconsistent.offsets = torch.tensor([0, 4, 3])
    with pytest.raises(ClusterFileError, match="offsets must rise"):
        inconsistent.save(tmp_path / "inconsistent.pt")
    path = tmp_path / "edited.pt"  # written by other code: checksum right, contents wrong
    small_file().save(path)
    payload = torch.load(path, weights_only=True)
    payload["tensors"]["offsets"] = torch.tensor([0, 4, 3])
    payload["checksum"] = _checksum(payload["metadata"], payload["tensors"])
    torch.save(payload, path)
    with pytest.raises(ClusterFileError, match="offsets must rise"):
        ClusterFile.load(path)


def test_file_of_another_model_is_refused(toy, full_coverage_path):
    other = copy.deepcopy(toy.model)
    with torch.no_grad():
        other.decoder.output_projection.weight[5, 0] += 0.01
    assert load_projection(full_coverage_path, toy.model) is not None
    with pytest.raises(ClusterFileError, match="made for another model .*projection_sha256"):
        load_projection(full_coverage_path, other)


def test_fingerprint_is_the_same_in_fp16(toy):
    half = copy.deepcopy(toy.model).half()
    assert ModelFingerprint.of_decoder(half.decoder) == ModelFingerprint.of_decoder(toy.model.decoder)


def test_clusters_without_eos_are_refused_for_decoding(toy, tmp_path):
    fingerprint = ModelFingerprint.of_decoder(toy.model.decoder)
    eos = toy.task.target_dictionary.eos()
    centroids = torch.zeros(2, fingerprint.hidden_size)
    path = tmp_path / "no_eos.pt"
    ClusterFile.build(centroids, [[eos, 10], [10, 11]], fingerprint, top_k=1, states=0).save(path)
    with pytest.raises(ClusterFileError, match="1 clusters \\(first: 1\\) lack eos"):
        load_projection(path, toy.model)
