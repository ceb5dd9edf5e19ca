"""--screened-projection: int8 estimates of every logit within a proven bound, float32 on the tokens that could be
a state's best; greedy and blockwise keep float32's tokens sentence by sentence, on every engine."""

import copy

import pytest
import torch

from fairseq_fastgen.cluster.screened import CHUNK, ROUNDING_MARGIN, ScreenedProjection, ScreenWeights, certified_top
from fairseq_fastgen.ops.int8_kernel import INPUT_LEVELS
from tests.cluster.test_cluster_decoding import SENTENCES, decode

SPECIAL = [0, 1, 2, 3]


class Projection(torch.nn.Module):
    """A decoder's shape as the projection sees it: ``output_projection`` (vocab x dim) and nothing else."""

    def __init__(self, vocab, dim, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.output_projection = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            self.output_projection.weight.copy_(torch.randn(vocab, dim, generator=generator) * dim ** -0.5)
            self.output_projection.bias.copy_(torch.randn(vocab, generator=generator) * 0.1)


def states_with_outliers(rows, dim, seed=1):
    """(rows, dim): normal states, a few with one large coordinate (a layer-norm output's outliers), near-ties."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, dim, generator=generator) * 3
    states[::5, 7] = 40.0
    return states


def test_every_estimate_lies_within_the_bound():
    decoder = Projection(vocab=3000, dim=96)
    linear = decoder.output_projection
    screen = ScreenWeights(linear.weight)
    states = states_with_outliers(64, 96)
    estimates = screen.rows(states, linear.bias)  # (64, 3000)
    exact = linear(states)
    magnitudes = states.abs()
    bound = (screen.half_scale * magnitudes.sum(1) + screen.half_l1 * magnitudes.amax(1) / INPUT_LEVELS
             + screen.rounding * magnitudes.sum(1))  # (64,) without the margin
    error = (exact - estimates).abs().amax(dim=1)
    assert (error <= bound).all()
    assert (error > 0).all()  # the estimates are int8's, not float32's
    # the screen's bound: the smaller of that one and the norms' (Cauchy-Schwarz), which is smaller here
    assert (error <= screen.bound(states)).all()
    assert (screen.bound(states) < bound).all()


def test_the_norms_bound_holds_for_states_along_a_rows_rounding_error():
    """A state along the rounding error of the token rounded worst meets Cauchy-Schwarz's worst case for that
    token's first term: its estimate stays within the bound at every magnitude."""
    decoder = Projection(vocab=3000, dim=96, seed=6)
    linear = decoder.output_projection
    screen = ScreenWeights(linear.weight)
    weight = linear.weight.detach()
    scales = screen.rows.scales.unsqueeze(1)  # (vocab, 1)
    residual = weight - torch.round(weight / scales) * scales  # (vocab, dim)
    worst = residual.norm(dim=1).argmax()
    direction = residual[worst] / residual[worst].norm()  # (dim,)
    states = torch.stack([direction * magnitude for magnitude in (0.5, 4.0, 30.0, 200.0)])  # (4, dim)
    error = (linear(states) - screen.rows(states, linear.bias)).abs()  # (4, vocab)
    assert (error.amax(dim=1) <= screen.bound(states)).all()
    # the worst token's error is a large share of the bound: the bound is not loose by orders of magnitude there
    assert (error[:, worst] > 0.3 * (screen.bound(states) - ROUNDING_MARGIN)).all()


@pytest.mark.parametrize("top", [3, 8])
def test_the_mth_best_threshold_is_reached_by_m_ordinary_tokens(top):
    """The screen's threshold for m > 1 (the m-th largest of the chunk maxima) is at most each state's m-th best
    ordinary estimate, with the specials far ahead and a vocabulary that ends in a shorter chunk; the estimates
    come back unchanged."""
    vocab = 100 * CHUNK + 7
    generator = torch.Generator().manual_seed(7)
    estimates = torch.randn(12, vocab, generator=generator)
    estimates[:5, 40:40 + 8 * 100:100] += 6.0  # some states' best tokens all in one chunk (every 100th token)
    estimates[5:8, 40:48] += 6.0  # others' side by side
    estimates[:, SPECIAL] = 50.0
    before = estimates.clone()
    threshold = ScreenedProjection(SPECIAL, top).mth_best_ordinary(estimates)
    assert torch.equal(estimates, before)
    ordinary = estimates[:, len(SPECIAL):]
    assert (threshold <= ordinary.topk(top, dim=1).values[:, -1]).all()
    # where the best tokens spread over chunks, no lower than the (3 m)-th best: 3 m tokens fill m chunks
    assert (threshold[5:] >= ordinary[5:].topk(3 * top, dim=1).values[:, -1]).all()


@pytest.mark.parametrize("top", [1, 3, 8])
def test_the_best_tokens_of_every_state_are_float32s(top):
    """The ``top`` best ordinary logits of each state (rows x positions), by index and value, and the special
    tokens' are the full float32 projection's; the other tokens keep estimates, not -inf."""
    decoder = Projection(vocab=3000, dim=96, seed=2)
    states = states_with_outliers(24, 96, seed=3).view(8, 3, 96)  # (rows, n, dim): a block of 3 positions
    projection = ScreenedProjection(SPECIAL, top)
    logits = projection(states, decoder)  # (8, 3, 3000)
    exact = decoder.output_projection(states)
    ordinary = torch.ones(3000, dtype=torch.bool)
    ordinary[SPECIAL] = False
    want = exact[..., ordinary].topk(top, dim=-1)
    got = logits[..., ordinary].topk(top, dim=-1)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[..., SPECIAL], exact[..., SPECIAL], rtol=0, atol=1e-5)
    assert torch.isfinite(logits).all()
    stats = projection.statistics.as_dict()
    assert stats["projection_states"] == 24 and 0 < stats["projection_active_fraction_mean"] < 0.5


def test_banned_best_token_leaves_the_next_one_certified():
    """A decoder that bans the best token of a state when it is a special one (eos below --min-len) picks the
    best ordinary token, which is float32's."""
    decoder = Projection(vocab=2000, dim=64, seed=4)
    with torch.no_grad():
        decoder.output_projection.bias[2] = 50.0  # eos far ahead of every token
    states = states_with_outliers(16, 64, seed=5).unsqueeze(1)
    logits = ScreenedProjection(SPECIAL, 1)(states, decoder)
    exact = decoder.output_projection(states)
    assert (logits.argmax(-1) == 2).all()
    logits[..., 2] = exact[..., 2] = float("-inf")
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_certified_top_follows_the_decoder():
    assert certified_top(1) == 1 and certified_top(5) == 10 and certified_top(1, 3) == 3


def decode_both(task, model, decoder, beam, **options):
    plain, _ = decode(task, model, decoder, beam, **options)
    screened, projection = decode(task, model, decoder, beam, screened_projection=True, **options)
    assert projection is not None, f"--decoder {decoder} ignored --screened-projection"
    return plain, screened, projection.statistics.as_dict()


def assert_same_tokens(plain, screened, tolerance):
    assert sorted(screened) == sorted(plain) and len(plain) >= SENTENCES
    for sentence_id, expected in plain.items():
        got = screened[sentence_id]
        assert torch.equal(got["tokens"], expected["tokens"]), sentence_id
        torch.testing.assert_close(got["positional_scores"], expected["positional_scores"], rtol=0, atol=tolerance)


@pytest.mark.parametrize("decoder,options", [
    ("greedy", {}), ("greedy", {"step_engine": "fairseq"}), ("greedy-stream", {}),
    ("greedy", {"step_engine": "compiled"}),
])
def test_greedy_keeps_float32s_tokens(toy, decoder, options):
    plain, screened, stats = decode_both(toy.task, copy.deepcopy(toy.model), decoder, 1, **options)
    assert_same_tokens(plain, screened, tolerance=0.05)
    assert stats["projection_steps"] > 0 and stats["projection_active_fraction_mean"] < 0.1


@pytest.mark.parametrize("decoder", ["blockwise", "blockwise-stream"])
def test_blockwise_keeps_float32s_tokens(khead, decoder):
    plain, screened, stats = decode_both(khead.task, copy.deepcopy(khead.model), decoder, 1)
    assert_same_tokens(plain, screened, tolerance=0.05)
    assert stats["projection_states"] > stats["projection_steps"]  # a block's positions screened together


def test_stock_beam_search_runs_on_the_screen(toy):
    """fairseq's beam search through the decoder's output layer: its 2 x beam candidates of each state are
    float32's; the hypotheses are compared in docs/benchmarks.md, not promised."""
    _, screened, stats = decode_both(toy.task, copy.deepcopy(toy.model), "beam", 4, step_engine="fairseq")
    assert stats["projection_steps"] > 0 and stats["projection_active_fraction_mean"] < 0.5
    assert all(len(hypothesis["tokens"]) > 0 for hypothesis in screened.values())


@pytest.mark.parametrize("options,message", [
    ({"cluster_projection": "clusters.pt"}, "give one of them"),
    ({"no_repeat_ngram_size": 2}, "--no-repeat-ngram-size"),
    ({"quantize": "int8"}, "--float32-vocabulary-projection"),
])
def test_what_it_cannot_serve_is_refused(toy, options, message):
    with pytest.raises(ValueError, match=message):
        decode(toy.task, copy.deepcopy(toy.model), "greedy", 1, screened_projection=True, **options)
