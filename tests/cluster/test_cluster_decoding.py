"""--cluster-projection in every decoder that runs a plain transformer.

A file whose active sets cover the whole vocabulary must leave every
decoder's output unchanged (tokens and scores, sentence by sentence), and the
projection must really have run.  Decoders are taken from the registry, so
those added later are covered once registered.
"""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class
from fairseq_fastgen.adapters.output_layer import attached_projection
from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, ModelFingerprint
from fairseq_fastgen.cluster.outside_mass import EstimatedNormalizer
from fairseq_fastgen.cluster.projection import FullNormalizer, nearest_clusters
from fairseq_fastgen.sequence_generators import DECODERS
from tests.float_scores import assert_same_scores

K_HEAD_DECODERS = {"blockwise", "blockwise-stream"}  # need a transformer_khead model: the toy k-head model below
EXPECTED_PLAIN_DECODERS = ["beam", "greedy", "greedy-stream", "var-batch", "var-stream", "fixed-stream"]
PLAIN_DECODERS = sorted(set(EXPECTED_PLAIN_DECODERS) | set(DECODERS) - K_HEAD_DECODERS)
SENTENCES = 24


@pytest.fixture(scope="module")
def model(toy):
    """A private copy: decoding may attach a projection to its decoder."""
    return copy.deepcopy(toy.model)


def batches(task, batch_size):
    iterator = task.get_batch_iterator(
        dataset=task.dataset("test"), max_sentences=batch_size, required_batch_size_multiple=1,
        disable_iterator_cache=True,  # fairseq would reuse the batches of an earlier call
    ).next_epoch_itr(shuffle=False)
    taken = 0
    for sample in iterator:
        if taken >= SENTENCES:
            break
        taken += sample["nsentences"]
        yield sample


def decode(task, model, decoder, beam, batch_size=12, **options):
    """(sentence id -> best hypothesis, the projection that ran or None)."""
    return run(task, model, build(task, model, decoder, beam, **options), batch_size)


def build(task, model, decoder, beam, **options):
    return task.build_generator([model], OmegaConf.structured(GenerationConfig(beam=beam, decoder=decoder, **options)))


def run(task, model, generator, batch_size=12):
    results = {}
    for sample in batches(task, batch_size):
        hypotheses = task.inference_step(generator, [model], sample)
        for sentence_id, hyps in zip(sample["id"].tolist(), hypotheses):
            results[sentence_id] = hyps[0]
    assert attached_projection(model.decoder) is None  # attached only while a generator generates
    runner = getattr(generator, "runner", None)
    return results, getattr(runner, "projection", None) or getattr(generator, "projection", None)


def assert_unchanged_by_whole_vocabulary_file(task, model, path, decoder, beam):
    return assert_unchanged_by_projection(task, model, decoder, beam, cluster_projection=str(path))


def assert_unchanged_by_projection(task, model, decoder, beam, common_options=None, **projection_options):
    """``common_options``: generation options of both runs (with and without the projection).
    Returns the projection that ran."""
    common_options = common_options or {}
    plain, no_projection = decode(task, model, decoder, beam, **common_options)
    projected, projection = decode(task, model, decoder, beam, **common_options, **projection_options)
    assert no_projection is None
    assert projection is not None, f"--decoder {decoder} ignored {projection_options}"
    stats = projection.statistics.as_dict()
    assert stats["projection_steps"] > 0 and stats["projection_active_fraction_mean"] == 1.0
    assert sorted(projected) == sorted(plain) and len(plain) >= SENTENCES
    # the compiled step's log-softmax (inside its unit) against the projection's (eager): inductor's vectorized sums
    # and ATen's may add in other orders (with AVX2 only; with AVX-512 on an AMD Zen 5 too, one sentence in about a
    # hundred), so there the scores agree to float32's rounding (the tokens still bit for bit)
    same_bits = common_options.get("step_engine") != "compiled"
    for sentence_id, expected in plain.items():
        got = projected[sentence_id]
        assert torch.equal(got["tokens"], expected["tokens"]), sentence_id
        for scores in ("score", "positional_scores"):
            assert_same_scores(got[scores], expected[scores], same_bits, sentence_id)
    return projection


@pytest.mark.parametrize("decoder", PLAIN_DECODERS)
def test_whole_vocabulary_file_changes_nothing(toy, model, full_coverage_path, decoder):
    if decoder not in DECODERS:
        pytest.skip(f"--decoder {decoder} is not registered (yet)")
    assert_unchanged_by_whole_vocabulary_file(toy.task, model, full_coverage_path, decoder, 1 if decoder == "greedy" else 4)


def test_whole_vocabulary_file_changes_nothing_in_stock_beam_on_fairseqs_runner(toy, model, full_coverage_path):
    """--step-engine fairseq: stock beam search over fairseq's runner, which projects through the file."""
    assert_unchanged_by_projection(toy.task, model, "beam", 4, common_options={"step_engine": "fairseq"},
                                   cluster_projection=str(full_coverage_path))


@pytest.mark.parametrize("decoder", PLAIN_DECODERS)
def test_time_projection_times_the_full_projection_and_changes_nothing(toy, model, decoder):
    if decoder not in DECODERS:
        pytest.skip(f"--decoder {decoder} is not registered (yet)")
    stats = assert_unchanged_by_projection(toy.task, model, decoder, 1 if decoder == "greedy" else 4,
                                           time_projection=True).statistics.as_dict()
    assert stats["projection_seconds"] > 0 and stats["projection_full_vocab_steps"] == stats["projection_steps"]
    assert stats["projection_ms_per_step"] == pytest.approx(1000 * stats["projection_seconds"] / stats["projection_steps"])


def test_whole_vocabulary_file_changes_nothing_on_the_compiled_engine(toy, model, full_coverage_path):
    """The compiled engine's step for a projection returns features, its step without one log-probabilities: a
    generator without the file decodes first, so the one with it must not run the first one's compiled code."""
    assert_unchanged_by_projection(toy.task, model, "greedy", 1, common_options={"step_engine": "compiled"},
                                   cluster_projection=str(full_coverage_path))


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_whole_vocabulary_file_changes_nothing_with_onednn_products(toy, model, full_coverage_path, decoder):
    """--onednn-linear composes with --cluster-projection: the full projection the file leaves in place
    goes through the same oneDNN product as the decoder's own projection."""
    from fairseq_fastgen.ops.onednn_linear import onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    assert_unchanged_by_projection(toy.task, model, decoder, 1 if decoder == "greedy" else 4,
                                   common_options={"onednn_linear": True}, cluster_projection=str(full_coverage_path))


@pytest.mark.parametrize("decoder", sorted(K_HEAD_DECODERS))
def test_whole_vocabulary_file_changes_nothing_in_blockwise(khead, khead_full_coverage_path, decoder):
    if decoder not in DECODERS:
        pytest.skip(f"--decoder {decoder} is not registered (yet)")
    stats = assert_unchanged_by_whole_vocabulary_file(khead.task, copy.deepcopy(khead.model), khead_full_coverage_path,
                                                      decoder, 1).statistics.as_dict()
    assert stats["projection_states"] > stats["projection_steps"]  # the k heads' states are projected together


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_bad_file_is_refused_when_the_generator_is_built(toy, model, tmp_path, decoder):
    path = tmp_path / "clusters.pt"
    path.write_bytes(b"not a cluster file")
    with pytest.raises(ClusterFileError, match="truncated, damaged or not a cluster file"):
        decode(toy.task, model, decoder, 1, cluster_projection=str(path))


@pytest.mark.parametrize("decoder", ["beam", "greedy"])
def test_generators_on_one_model_keep_their_own_projection(toy, model, trained_cluster_path, decoder):
    """A bench builds every configuration's generator on the same model, then runs them
    in turn: each must decode with its own projection (or none), whatever was built after it."""
    alone = {name: decode(toy.task, model, decoder, 2, **options)[0] for name, options in
             [("plain", {}), ("clusters", {"cluster_projection": str(trained_cluster_path)})]}
    assert any(not torch.equal(alone["plain"][i]["tokens"], alone["clusters"][i]["tokens"]) for i in alone["plain"])
    with_clusters = build(toy.task, model, decoder, 2, cluster_projection=str(trained_cluster_path))
    plain = build(toy.task, model, decoder, 2)
    timed = build(toy.task, model, decoder, 2, time_projection=True)
    for generator, name in [(with_clusters, "clusters"), (plain, "plain"), (timed, "plain"), (with_clusters, "clusters")]:
        results, _ = run(toy.task, model, generator)
        for sentence_id, expected in alone[name].items():
            assert torch.equal(results[sentence_id]["tokens"], expected["tokens"]), (name, sentence_id)
            assert torch.equal(results[sentence_id]["score"], expected["score"]), (name, sentence_id)


def teacher_forced(model, task, sentence_id, tokens):
    """Final decoder states (length, hidden) and full logits (length, vocab) of ``tokens`` (ending in eos)."""
    eos = task.target_dictionary.eos()
    source = task.dataset("test")[sentence_id]["source"].unsqueeze(0)
    prev = torch.cat([torch.tensor([eos]), tokens[:-1]]).unsqueeze(0)
    with torch.no_grad():
        features, _ = model(source, torch.tensor([source.size(1)]), prev, features_only=True)
        return features[0], model.decoder.output_layer(features[0])


def test_greedy_picks_the_best_token_of_its_cluster(toy, model, trained_cluster_path):
    """At batch size 1 the union is the active set of the state's own cluster:
    every greedy token is the argmax of the full logits over that set."""
    results, projection = decode(toy.task, model, "greedy", 1, batch_size=1,
                                 cluster_projection=str(trained_cluster_path))
    cluster_file = ClusterFile.load(trained_cluster_path)
    assert projection.statistics.as_dict()["projection_active_fraction_max"] < 1.0
    for sentence_id, hypothesis in results.items():
        tokens = hypothesis["tokens"]  # (length,) ending in eos
        states, logits = teacher_forced(model, toy.task, sentence_id, tokens)
        clusters = nearest_clusters(states, cluster_file.centroids, cluster_file.centroid_sqnorms)
        if tokens.numel() >= model.max_decoder_positions() - 1:
            tokens = tokens[:-1]  # eos forced at the length limit
        for position, (cluster, token) in enumerate(zip(clusters.tolist(), tokens.tolist())):
            allowed = cluster_file.cluster_tokens(cluster)
            assert token in allowed.tolist(), (sentence_id, position)
            best = allowed[logits[position, allowed].argmax()]
            assert token == int(best), (sentence_id, position)


def test_greedy_with_two_nearest_clusters_picks_the_best_token_of_their_union(toy, model, trained_cluster_path):
    """--cluster-nearest 2 at batch size 1: every greedy token is the argmax of the full logits over the union of
    the active sets of the state's two nearest centroids (distances computed here, not by the plugin), and the
    projection is wider than with the nearest cluster alone."""
    _, narrow = decode(toy.task, model, "greedy", 1, batch_size=1, cluster_projection=str(trained_cluster_path))
    results, projection = decode(toy.task, model, "greedy", 1, batch_size=1,
                                 cluster_projection=str(trained_cluster_path), cluster_nearest=2)
    assert projection.nearest == 2
    widths = [p.statistics.as_dict()["projection_active_fraction_mean"] for p in (narrow, projection)]
    assert widths[0] < widths[1] < 1.0
    cluster_file = ClusterFile.load(trained_cluster_path)
    for sentence_id, hypothesis in results.items():
        tokens = hypothesis["tokens"]  # (length,) ending in eos
        states, logits = teacher_forced(model, toy.task, sentence_id, tokens)
        distances = torch.cdist(states.double(), cluster_file.centroids.double())  # (length, clusters)
        two_nearest = distances.argsort(dim=1)[:, :2]  # (length, 2)
        if tokens.numel() >= model.max_decoder_positions() - 1:
            tokens = tokens[:-1]  # eos forced at the length limit
        for position, token in enumerate(tokens.tolist()):
            allowed = torch.cat([cluster_file.cluster_tokens(c) for c in two_nearest[position].tolist()]).unique()
            assert token in allowed.tolist(), (sentence_id, position)
            assert token == int(allowed[logits[position, allowed].argmax()]), (sentence_id, position)


def test_cluster_nearest_beyond_the_files_clusters_or_without_a_file_is_refused(toy, model, trained_cluster_path):
    clusters = ClusterFile.load(trained_cluster_path).centroids.size(0)
    with pytest.raises(ClusterFileError, match=f"--cluster-nearest {clusters + 1}: .* has {clusters} clusters"):
        decode(toy.task, model, "greedy", 1, cluster_projection=str(trained_cluster_path),
               cluster_nearest=clusters + 1)
    with pytest.raises(ValueError, match="--cluster-nearest 2 chooses among the clusters of a file"):
        decode(toy.task, model, "greedy", 1, cluster_nearest=2)


def test_full_normalizer_keeps_the_tokens_and_scores_them_with_the_full_softmax(toy, model, trained_cluster_path):
    """--cluster-full-normalizer: the same greedy tokens as the cluster projection alone
    (a row's shift does not move its argmax), each scored by the full vocabulary's
    log-softmax, not by the softmax over the active tokens."""
    reduced, _ = decode(toy.task, model, "greedy", 1, batch_size=1, cluster_projection=str(trained_cluster_path),
                        cluster_union_normalizer=True)
    normalized, projection = decode(toy.task, model, "greedy", 1, batch_size=1,
                                    cluster_projection=str(trained_cluster_path), cluster_full_normalizer=True)
    assert isinstance(projection.normalizer, FullNormalizer)
    assert projection.statistics.as_dict()["projection_active_fraction_max"] < 1.0
    raised = 0
    for sentence_id, (scores, reduced_scores, full) in scored_against_full(model, toy.task, normalized, reduced):
        torch.testing.assert_close(scores, full, rtol=1e-4, atol=1e-4)
        raised += int((reduced_scores > full + 1e-3).any())
    assert raised > 0  # the active-only softmax did raise some scores: the normaliser made a difference


def test_the_files_estimate_keeps_greedys_tokens_and_scores_them_nearer_the_full_softmax(toy, model,
                                                                                        trained_cluster_path):
    """By default a file from fastgen-train-clusters adds its estimate of the mass outside the active tokens to
    the softmax's normaliser: the same greedy tokens as over the active tokens alone, each scored nearer the full
    vocabulary's log-softmax than that softmax scores it."""
    union, _ = decode(toy.task, model, "greedy", 1, batch_size=1, cluster_projection=str(trained_cluster_path),
                      cluster_union_normalizer=True)
    estimated, projection = decode(toy.task, model, "greedy", 1, batch_size=1,
                                   cluster_projection=str(trained_cluster_path))
    assert isinstance(projection.normalizer, EstimatedNormalizer)
    union_error = estimate_error = 0.0
    for sentence_id, (scores, union_scores, full) in scored_against_full(model, toy.task, estimated, union):
        assert (scores <= union_scores + 1e-5).all(), sentence_id  # the estimate only adds mass
        estimate_error += float((scores - full).abs().sum())
        union_error += float((union_scores - full).abs().sum())
    assert estimate_error < 0.5 * union_error


def scored_against_full(model, task, hypotheses, others):
    """Per sentence of two greedy decodes that must give the same tokens: (sentence id, (positional scores of
    ``hypotheses``, of ``others``, the full vocabulary's log-softmax of those tokens)), each (length,)."""
    assert sorted(hypotheses) == sorted(others)
    for sentence_id, hypothesis in hypotheses.items():
        tokens = hypothesis["tokens"]
        assert torch.equal(tokens, others[sentence_id]["tokens"]), sentence_id
        _, logits = teacher_forced(model, task, sentence_id, tokens)
        full = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)  # (length,)
        if tokens.numel() >= model.max_decoder_positions() - 1:
            full, tokens = full[:-1], tokens[:-1]  # eos forced at the length limit
        length = tokens.numel()
        yield sentence_id, (hypothesis["positional_scores"][:length], others[sentence_id]["positional_scores"][:length],
                            full)


def test_two_normalisers_at_once_are_refused(toy, model, trained_cluster_path):
    with pytest.raises(ValueError, match="--cluster-full-normalizer and --cluster-union-normalizer .*give one"):
        decode(toy.task, model, "greedy", 1, cluster_projection=str(trained_cluster_path),
               cluster_full_normalizer=True, cluster_union_normalizer=True)


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
@pytest.mark.parametrize("normalizer", ["full", "union"])
def test_a_normaliser_without_a_cluster_file_is_refused(toy, model, decoder, normalizer):
    with pytest.raises(ValueError, match=f"--cluster-{normalizer}-normalizer .*--cluster-projection FILE"):
        decode(toy.task, model, decoder, 1, **{f"cluster_{normalizer}_normalizer": True})


def test_fingerprint_matches_the_model(toy, trained_cluster_path):
    assert ClusterFile.load(trained_cluster_path).fingerprint == ModelFingerprint.of_decoder(toy.model.decoder)
