"""The cluster projection equals a direct computation: nearest centroid by
brute-force distance, union of the chosen clusters' sets as a Python set,
full logits where the union holds a token, -inf elsewhere."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears
from fairseq_fastgen.adapters.output_layer import attach, attached_projection, detach
from fairseq_fastgen.cluster.clusterfile import ClusterFile, ModelFingerprint
from fairseq_fastgen.cluster.projection import DENSE_FRACTION, ClusterProjection, FullNormalizer, padded_width
from fairseq_fastgen.ops.onednn_linear import onednn_available, onednn_linear

# the module (the package exports its function under the same name)
onednn_module = importlib.import_module("fairseq_fastgen.ops.onednn_linear")

VOCAB, HIDDEN, CLUSTERS = 80, 8, 6


def random_case(choice, rows, steps, bias, seed, smallest_set=3):
    """A projection layer, a cluster file (set sizes from ``smallest_set`` up),
    and features near the centroids given by ``choice`` (so the nearest
    cluster of every state is known)."""
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(VOCAB, generator=generator))
    centroids = torch.randn(CLUSTERS, HIDDEN, generator=generator) * 4
    token_lists = [torch.randperm(VOCAB, generator=generator)[: smallest_set + 2 * c].tolist()
                   for c in range(CLUSTERS)]
    states = rows * steps
    nearest = {
        "random": lambda: torch.randint(0, CLUSTERS, (states,), generator=generator),
        "all-same": lambda: torch.full((states,), 2),
        "all-different": lambda: torch.randperm(CLUSTERS, generator=generator)[:states],
    }[choice]()
    features = centroids[nearest] + 0.01 * torch.randn(states, HIDDEN, generator=generator)
    fingerprint = ModelFingerprint(VOCAB, HIDDEN, "not checked here")
    cluster_file = ClusterFile.build(centroids, token_lists, fingerprint, top_k=1, states=0)
    return linear, cluster_file, token_lists, features.view(rows, steps, HIDDEN)


def direct_logits(features, linear, centroids, token_lists):
    states = features.reshape(-1, HIDDEN)
    chosen = [int(((centroids - state) ** 2).sum(dim=1).argmin()) for state in states]
    union = set()
    for cluster in chosen:
        union.update(token_lists[cluster])
    full = features @ linear.weight.t() + (linear.bias if linear.bias is not None else 0)
    in_union = torch.tensor([token in union for token in range(VOCAB)])
    return torch.where(in_union, full, torch.full_like(full, -math.inf)), len(union)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("choice, rows, steps, smallest_set, dense", [
    ("random", 5, 1, 3, False), ("random", 3, 2, 3, False), ("all-same", 7, 1, 3, False),
    ("all-different", CLUSTERS, 1, 3, False), ("all-different", 2, 3, 3, False),
    ("all-different", 2, 1, 45, True), ("all-same", 4, 1, 45, True),  # union above DENSE_FRACTION
])
def test_projection_equals_direct_computation(choice, rows, steps, smallest_set, dense, bias):
    linear, cluster_file, token_lists, features = random_case(choice, rows, steps, bias, rows * 10 + steps, smallest_set)
    projection = ClusterProjection(cluster_file)
    logits = projection(features, SimpleNamespace(output_projection=linear))
    expected, active = direct_logits(features, linear, cluster_file.centroids, token_lists)
    assert (active > DENSE_FRACTION * VOCAB) == dense and active < VOCAB
    assert logits.shape == (rows, steps, VOCAB)
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    if choice == "all-same":
        assert active == len(token_lists[2])
    stats = projection.statistics.as_dict()
    assert stats["projection_steps"] == 1 and stats["projection_states"] == rows * steps
    assert stats["projection_active_fraction_max"] == pytest.approx(active / VOCAB)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("choice, smallest_set", [("random", 3), ("all-same", 3), ("all-same", 45)])
@pytest.mark.parametrize("pad", [1, None])  # None: a token of the union
def test_full_normalizer_gives_the_full_log_softmax_on_the_union(choice, smallest_set, pad, temperature):
    linear, cluster_file, token_lists, features = random_case(choice, 4, 2, True, 7, smallest_set)
    pad = token_lists[2][0] if pad is None else pad
    projection = ClusterProjection(cluster_file, FullNormalizer(pad, temperature))
    logits = projection(features, SimpleNamespace(output_projection=linear))  # (4, 2, VOCAB)
    direct, active = direct_logits(features, linear, cluster_file.centroids, token_lists)
    assert active < VOCAB
    candidates = torch.isfinite(direct)
    candidates[..., pad] = False  # pad holds the mass outside the union; decoders ban it
    full = features @ linear.weight.t() + linear.bias  # (4, 2, VOCAB)
    expected = torch.log_softmax(full / temperature, dim=-1)
    got = torch.log_softmax(logits / temperature, dim=-1)
    assert torch.equal(torch.isfinite(got) & candidates, candidates)
    torch.testing.assert_close(got[candidates], expected[candidates], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(got[~candidates & (torch.arange(VOCAB) != pad)]).any()
    # without it, candidates score higher (never lower): the softmax ran over the union only
    plain = torch.log_softmax(ClusterProjection(cluster_file)(features, SimpleNamespace(output_projection=linear))
                              / temperature, dim=-1)
    raised = plain[candidates] - expected[candidates]
    assert raised.min() > -1e-5 and raised.max() > 1e-3


def test_statistics_over_steps():
    linear, cluster_file, token_lists, _ = random_case("random", 1, 1, False, seed=3)
    projection = ClusterProjection(cluster_file)
    decoder = SimpleNamespace(output_projection=linear)
    for cluster in (0, 5, 5):
        projection(cluster_file.centroids[cluster].view(1, 1, HIDDEN), decoder)
    stats = projection.statistics.as_dict()
    fractions = [len(token_lists[c]) / VOCAB for c in (0, 5, 5)]
    assert stats["projection_steps"] == 3
    assert stats["projection_active_fraction_mean"] == pytest.approx(sum(fractions) / 3)
    assert stats["projection_active_fraction_max"] == pytest.approx(max(fractions))
    assert stats["projection_full_vocab_steps"] == 0
    assert stats["projection_seconds"] > 0


def test_whole_vocabulary_union_is_the_full_projection(toy):
    """On the toy decoder's real projection: bit-identical logits."""
    decoder = toy.model.decoder
    fingerprint = ModelFingerprint.of_decoder(decoder)
    every_token = list(range(fingerprint.vocab_size))
    centroids = torch.randn(3, fingerprint.hidden_size, generator=torch.Generator().manual_seed(0))
    projection = ClusterProjection(ClusterFile.build(centroids, [every_token] * 3, fingerprint, top_k=1, states=0))
    features = torch.randn(9, 1, fingerprint.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(projection(features, decoder), decoder.output_layer(features))
    assert projection.statistics.as_dict()["projection_full_vocab_steps"] == 1


def test_attach_routes_decoder_forward(toy):
    """--decoder beam calls decoder.forward: the attached projection replaces its output layer, and detach restores it."""
    decoder = toy.model.decoder
    fingerprint = ModelFingerprint.of_decoder(decoder)
    eos = toy.task.target_dictionary.eos()
    centroids = torch.randn(2, fingerprint.hidden_size, generator=torch.Generator().manual_seed(0))
    projection = ClusterProjection(ClusterFile.build(centroids, [[eos, 7, 9], [eos, 8]], fingerprint, top_k=1, states=0))
    sample = toy.task.dataset("test")[0]
    src = sample["source"].unsqueeze(0)
    prev = torch.cat([torch.tensor([eos]), sample["target"][:-1]]).unsqueeze(0)
    with torch.no_grad():
        encoder_out = toy.model.encoder(src, torch.tensor([src.size(1)]))
        plain, _ = decoder(prev, encoder_out=encoder_out)
        attach(decoder, projection)
        try:
            assert attached_projection(decoder) is projection
            projected, _ = decoder(prev, encoder_out=encoder_out)
        finally:
            detach(decoder)
        restored, _ = decoder(prev, encoder_out=encoder_out)
    assert attached_projection(decoder) is None
    assert torch.equal(restored, plain)
    active = projected[0].isfinite().all(dim=0)  # (vocab,) the union over the sentence's states
    assert set(active.nonzero().squeeze(1).tolist()) <= {eos, 7, 8, 9}
    torch.testing.assert_close(projected[..., active], plain[..., active])
    assert projection.statistics.as_dict()["projection_states"] == prev.size(1)


def test_reduced_width_takes_few_sizes_and_wastes_at_most_an_eighth():
    widths = [padded_width(active, 32008) for active in range(1, 32009)]
    assert all(active <= width <= min(32008, active + active // 8 + 1) for active, width in enumerate(widths, 1))
    assert widths == sorted(widths) and widths[-1] == 32008
    for octave in range(4, 15):  # the actives of each power of two: 8 widths, and the next power of two
        assert len({padded_width(a, 32008) for a in range(1 << octave, 2 << octave)}) == 9


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [64, 320])
def test_onednn_linear_computes_the_reduced_projection_and_the_distances(rows, monkeypatch):
    """With --onednn-linear attached to the projection, the centroid distances and the
    product on the union's rows run through oneDNN (both shapes are large enough) and
    give the direct computation's logits within fp32 rounding, -inf at the same places."""
    vocab, hidden, clusters = 8008, 256, 250
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(hidden, vocab).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(vocab, hidden, generator=generator) * 0.05)
    centroids = torch.randn(clusters, hidden, generator=generator)
    token_lists = [torch.randperm(vocab, generator=generator)[:6].tolist() for _ in range(clusters)]
    nearest = torch.randint(0, clusters, (rows,), generator=generator)
    features = (centroids[nearest] + 0.01 * torch.randn(rows, hidden, generator=generator)).view(rows, 1, hidden)
    cluster_file = ClusterFile.build(centroids, token_lists, ModelFingerprint(vocab, hidden, "-"), top_k=1, states=0)
    calls = []

    def counted(x, weight, bias):
        calls.append(tuple(weight.shape))
        return onednn_linear(x, weight, bias)

    monkeypatch.setattr(onednn_module, "onednn_linear", counted)
    with OneDNNLinears(linear).attached():
        logits = ClusterProjection(cluster_file)(features, SimpleNamespace(output_projection=linear))
    union = set()
    for cluster in nearest.tolist():
        union.update(token_lists[cluster])
    assert len(union) < DENSE_FRACTION * vocab
    assert calls == [(clusters, hidden), (padded_width(len(union), vocab), hidden)]
    in_union = torch.tensor([token in union for token in range(vocab)])
    assert torch.equal(torch.isfinite(logits), in_union.expand(rows, 1, vocab))
    full = torch.nn.functional.linear(features, linear.weight, linear.bias)  # torch's own product
    bound = 2 * hidden * torch.finfo(torch.float32).eps * torch.nn.functional.linear(
        features.abs().double(), linear.weight.abs().double(), linear.bias.abs().double())
    assert ((logits.double() - full.double()).abs()[..., in_union] <= bound[..., in_union]).all()
