"""The pieces of fastgen-train-clusters: active sets from member states, and
the states recorded on source text only (free-running greedy decoding)."""

import numpy as np
import torch

from fairseq_fastgen.cluster.outside_mass import exact_log_outside, fit_outside_mass, outside_masks
from fairseq_fastgen.cluster.train import (
    ClusterTrainingConfig, cluster_active_sets, greedy_generator, greedy_targets, record_states,
    states_and_top_tokens,
)


def test_active_sets_are_the_members_top_tokens_plus_specials():
    generator = torch.Generator().manual_seed(0)
    vocab_size, hidden, clusters = 40, 5, 7
    centroids = torch.randn(clusters, hidden, generator=generator) * 5
    members = [0, 0, 1, 3, 3, 3, 5, 6, 6]  # clusters 2 and 4 get no member
    states = centroids[members] + 0.01 * torch.randn(len(members), hidden, generator=generator)
    top_tokens = torch.randint(4, vocab_size, (len(members), 2), generator=generator)
    specials = [0, 2, 3]
    active_sets = cluster_active_sets(states.numpy(), top_tokens.numpy(), centroids, specials, vocab_size)

    def nearest_state(cluster):
        return int(((states - centroids[cluster]) ** 2).sum(dim=1).argmin())

    for cluster in range(clusters):
        own = [i for i, c in enumerate(members) if c == cluster] or [nearest_state(cluster)]
        expected = sorted(set(specials) | {int(t) for i in own for t in top_tokens[i]})
        start, end = active_sets.offsets[cluster], active_sets.offsets[cluster + 1]
        assert active_sets.tokens[start:end].tolist() == expected, cluster


def test_source_only_states_are_those_of_greedy_decoding(toy):
    """Teacher-forced on the greedy output, each state's best token is the next greedy token."""
    model, task = toy.model, toy.task
    pad = task.target_dictionary.pad()
    sample = next(iter(task.get_batch_iterator(
        dataset=task.dataset("test"), max_sentences=6, required_batch_size_multiple=1, disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=False)))
    with torch.no_grad():
        prev_output_tokens, targets = greedy_targets(greedy_generator(model, task), model, task, sample)
        states, top_tokens = states_and_top_tokens(model, sample, prev_output_tokens, targets, 3, pad)
    eos = task.target_dictionary.eos()
    assert targets.eq(pad).any() and torch.equal(prev_output_tokens.ne(pad), targets.ne(pad))
    assert prev_output_tokens[:, 0].eq(eos).all() and targets.eq(eos).sum() == targets.size(0)
    assert states.shape == (int(targets.ne(pad).sum()), model.decoder.output_projection.in_features)
    assert torch.equal(top_tokens[:, 0], targets[targets.ne(pad)])


def test_record_states_stops_at_max_states(toy):
    cfg = ClusterTrainingConfig(data="", path="", output="", split="test", top_k=2, max_states=123, max_tokens=500)
    with torch.no_grad():
        states, top_tokens = record_states(toy.model, toy.task, cfg)
    assert states.shape == (123, toy.model.decoder.output_projection.in_features) and states.dtype == np.float32
    assert top_tokens.shape == (123, 2)
    assert not np.isin(top_tokens, [toy.task.target_dictionary.pad()]).any()


def test_the_outside_mass_estimate_follows_each_state_closer_than_its_centroids_value():
    """Per cluster a first-order estimate of the log of the softmax mass outside its tokens, its intercept
    corrected on the members: on held-out states of the clusters it is nearer the exact value than the value at
    the centroid is (the estimate a constant per cluster would give), and the error is small against the spread."""
    generator = torch.Generator().manual_seed(0)
    vocab_size, hidden, clusters = 300, 16, 6
    weight = torch.randn(vocab_size, hidden, generator=generator) * 0.5
    bias = torch.randn(vocab_size, generator=generator) * 0.3
    centroids = torch.randn(clusters, hidden, generator=generator) * 2
    assignment = torch.arange(clusters).repeat_interleave(400)  # (2400,)
    states = centroids[assignment] + 0.5 * torch.randn(assignment.numel(), hidden, generator=generator)
    top = (states @ weight.t() + bias).topk(5, dim=1).indices.numpy()
    active_sets = cluster_active_sets(states.numpy(), top, centroids, [2], vocab_size, assignment)
    train, held_out = torch.arange(0, 2400, 2), torch.arange(1, 2400, 2)
    intercepts, gradients = fit_outside_mass(states[train], assignment[train], centroids, active_sets, weight, bias)
    assert intercepts.shape == (clusters,) and gradients.shape == (clusters, hidden)
    outside = outside_masks(active_sets, clusters, vocab_size)
    members = assignment[held_out]
    exact = exact_log_outside(states[held_out], weight, bias, outside[members])  # (held out,)
    estimate = intercepts[members] + (gradients[members] * states[held_out]).sum(dim=1)
    at_centroid = exact_log_outside(centroids, weight, bias, outside)[members]
    error, constant_error = (estimate - exact).abs().mean(), (at_centroid - exact).abs().mean()
    assert error < 0.5 * constant_error and error < 0.2 * exact.std()
