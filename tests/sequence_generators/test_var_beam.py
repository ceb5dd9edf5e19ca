"""Variable-width and fixed-width beam search (var_beam.py) on the toy model.

Every comparison is sentence by sentence: tokens, scores and positional
scores bitwise (fp32, CPU).  The models run with one thread: bit-exactness
holds with two as well (see streaming.py), but one thread is much faster on
the shared CI machines.
"""

import math
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from fairseq_fastgen.sequence_generators import generator as generator_module
from fairseq_fastgen.sequence_generators.streaming import PADDING_SENTENCE, kernels_are_companion_free, select_padded

TEST_SENTENCES = 200


@dataclass
class Toy:
    models: list
    task: object
    dataset: object

    def sample(self, ids):
        return self.dataset.collater([self.dataset[i] for i in ids])

    def generator(self, **options):
        from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class once imported

        return self.task.build_generator(self.models, OmegaConf.structured(GenerationConfig(**options)))

    def translate(self, generator, ids):
        """{sentence id: hypotheses} for the dataset sentences ``ids`` decoded in one generate() call."""
        sample = self.sample(ids)
        results = generator.generate(self.models, sample)
        return dict(zip(sample["id"].tolist(), results))


def load_toy(toy_model):
    import fairseq_fastgen  # noqa: F401  (registers the decoders)
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy_model.checkpoint)], arg_overrides={"data": str(toy_model.data_bin)}
    )
    task.load_dataset("test")
    for model in models:
        model.eval()
    return Toy(models, task, task.dataset("test"))


@pytest.fixture(scope="module")
def toy(toy_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_toy(toy_model)
    torch.set_num_threads(threads)


def assert_identical(expected, actual, across_batches=False):
    """Sentence by sentence: tokens, scores and positional scores bitwise.  ``across_batches``: the two
    sides ran the sentence in batches of other companions, which gives the same bits only on CPUs whose
    kernels are companion-free (streaming.py); elsewhere the tokens, and the scores within 1e-5."""
    exact = not across_batches or kernels_are_companion_free(torch.get_num_threads())
    assert expected.keys() == actual.keys()
    for sentence, hypotheses in expected.items():
        assert len(actual[sentence]) == len(hypotheses), sentence
        for want, got in zip(hypotheses, actual[sentence]):
            assert torch.equal(got["tokens"], want["tokens"]), sentence
            if exact:
                assert torch.equal(got["score"], want["score"]), sentence
                assert torch.equal(got["positional_scores"], want["positional_scores"]), sentence
            else:
                assert abs(float(got["score"]) - float(want["score"])) <= 1e-5, sentence
                assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-5, rtol=0), sentence


# ---- fixed-width search against a plain one-sentence beam search -------------------------------
class OneSentenceBeamSearch:
    """Fixed-width beam search of a single sentence, written plainly as a reference.

    Each step takes the ``beam - collected`` best of all beam x vocab continuations
    and of the finished candidates still on the beam; finished candidates at the top
    are collected (up to nbest), the others stay on the beam.
    """

    def __init__(self, beam, nbest):
        self.beam, self.nbest = beam, nbest

    def start(self, state, ctx):
        assert state.rows == 1
        self.waiting, self.collected = [], []  # waiting: (score, hypothesis)
        select_padded(state, torch.tensor([0]))
        return state

    def advance(self, state, ctx):
        lprobs, attn = ctx.next_lprobs(state)  # (rows, vocab)
        open_rows = int(state.sentence.ne(PADDING_SENTENCE).sum())
        vocab = lprobs.size(1)
        width = self.beam - len(self.collected)
        scores = (state.scores[:open_rows].unsqueeze(1) + lprobs[:open_rows]).flatten()
        top, flat = scores.topk(width)
        new = [(score, index) for score, index in zip(top.tolist(), flat.tolist()) if score > -math.inf]
        candidates = [(score, "new", i) for i, (score, _) in enumerate(new)]
        candidates += [(score, "waiting", i) for i, (score, _) in enumerate(self.waiting)]
        candidates = sorted(candidates, key=lambda c: -c[0])[:width]

        parents = torch.tensor([index // vocab for _, index in new], dtype=torch.long)
        tokens = torch.tensor([index % vocab for _, index in new], dtype=torch.long)
        sentence = int(state.sentence[0])
        state.select(parents)
        state.append(tokens.unsqueeze(1), lprobs[parents, tokens].unsqueeze(1), attn[parents].unsqueeze(2))
        finished = tokens.eq(ctx.eos).tolist()

        waiting, open_rows = [], []
        for score, origin, i in candidates:
            is_finished = origin == "waiting" or finished[i]
            if is_finished:
                hypothesis = self.waiting[i][1] if origin == "waiting" else ctx.hypothesis(state, i)
                if not open_rows and not waiting and len(self.collected) < self.nbest:
                    self.collected.append(hypothesis)
                else:
                    waiting.append((score, hypothesis))
            else:
                open_rows.append(i)
        self.waiting = waiting
        if len(self.collected) == self.nbest or not open_rows:
            ctx.finish(sentence, self.collected)
            open_rows = []
        select_padded(state, torch.tensor(open_rows, dtype=torch.long))


@pytest.mark.parametrize("beam, nbest", [(4, 1), (3, 2)])
def test_fixed_width_search_equals_plain_one_sentence_beam_search(toy, beam, nbest):
    """Batched (ragged, vectorised) fixed-width search = the plain reference run on each sentence alone."""
    ids = list(range(0, TEST_SENTENCES, 8))
    batched = toy.translate(toy.generator(decoder="fixed-stream", beam=beam, nbest=nbest), ids)
    reference = toy.generator(decoder="fixed-stream", beam=beam, nbest=nbest)
    reference.policy = OneSentenceBeamSearch(beam, nbest)
    alone = {}
    for i in ids:
        alone.update(toy.translate(reference, [i]))
    assert_identical(alone, batched, across_batches=True)
    assert all(len(h) == nbest for h in batched.values())


def test_var_batch_at_loosest_pruning_equals_fixed_width_search(toy):
    ids = range(0, TEST_SENTENCES, 2)
    fixed = toy.translate(toy.generator(decoder="fixed-stream", beam=5), ids)
    loosest = toy.generator(decoder="var-batch", beam=5, var_beam_delta=math.inf, var_beam_max_cands=100)
    assert_identical(fixed, toy.translate(loosest, ids))


def test_pruning_at_delta_zero_is_greedy_search(toy):
    """delta = 0 keeps only the best candidate of each beam: beam 5 becomes beam 1."""
    ids = range(0, TEST_SENTENCES, 2)
    greedy = toy.translate(toy.generator(decoder="var-batch", beam=1), ids)
    assert_identical(greedy, toy.translate(toy.generator(decoder="var-batch", beam=5, var_beam_delta=0.0), ids))


def test_default_pruning_expands_fewer_candidates_than_fixed_width(toy):
    ids = range(0, TEST_SENTENCES, 2)
    fixed, pruned = toy.generator(decoder="fixed-stream", beam=5), toy.generator(decoder="var-batch", beam=5)
    toy.translate(fixed, ids)
    toy.translate(pruned, ids)
    assert pruned.counters.counts["candidate_expansions"] < 0.8 * fixed.counters.counts["candidate_expansions"]


def test_nbest_lenpen_length_limits_and_ngram_blocking(toy):
    ids = range(0, TEST_SENTENCES, 3)
    options = dict(beam=4, nbest=3, lenpen=0.6, no_repeat_ngram_size=2, max_len_a=0.8, max_len_b=2)
    results = toy.translate(toy.generator(decoder="var-batch", var_beam_delta=3.0, **options), ids)
    for sentence, hypotheses in results.items():
        source_width = toy.dataset[sentence]["source"].numel()  # eos included, as stock's src_tokens.size(1)
        assert 1 <= len(hypotheses) <= 3
        scores = [float(h["score"]) for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        for h in hypotheses:
            tokens = h["tokens"].tolist()
            assert tokens[-1] == toy.task.target_dictionary.eos() and tokens.count(toy.task.target_dictionary.eos()) == 1
            assert len(tokens) - 1 <= math.floor(0.8 * source_width + 2 + 1e-4)
            bigrams = list(zip(tokens, tokens[1:]))
            assert len(bigrams) == len(set(bigrams)), (sentence, tokens)
            normalised = h["positional_scores"].sum() / len(tokens) ** 0.6
            assert math.isclose(float(h["score"]), float(normalised), rel_tol=1e-5)


def test_unnormalized_scores_are_cumulative_log_probabilities(toy):
    ids = range(0, TEST_SENTENCES, 5)
    results = toy.translate(toy.generator(decoder="var-batch", beam=4, unnormalized=True), ids)
    for hypotheses in results.values():
        (best,) = hypotheses
        assert math.isclose(float(best["score"]), float(best["positional_scores"].sum()), rel_tol=1e-5, abs_tol=1e-5)


def test_statistics_count_every_expanded_row(toy, monkeypatch):
    rows_run, calls = [], []
    original = generator_module.DecodeContext.next_lprobs

    def counting_next_lprobs(ctx, state):
        rows_run.append(int(state.sentence.ne(PADDING_SENTENCE).sum()))
        calls.append(state.rows)
        return original(ctx, state)

    monkeypatch.setattr(generator_module.DecodeContext, "next_lprobs", counting_next_lprobs)
    generator = toy.generator(decoder="var-stream", beam=5, stream_capacity=10)
    toy.translate(generator, range(60))
    toy.translate(generator, range(60, 100))
    counts = generator.counters.counts
    per_step = generator.counters.per_step["candidate_expansions"]
    assert counts["candidate_expansions"] == sum(per_step) == sum(rows_run)
    assert per_step == rows_run
    assert counts["model_calls"] == counts["iterations"] == len(per_step) == len(calls)
    assert all(rows % 4 == 0 for rows in calls)  # padded row counts (streaming.py)
    assert counts["sentences"] == 100 and counts["refills"] >= 8
    stats = generator.counters.as_dict()
    assert stats["candidate_expansions_per_step"] == pytest.approx(sum(rows_run) / len(rows_run))


def test_every_sentence_gets_a_result_when_every_continuation_is_banned(toy):
    """--min-len above the length limit bans eos where it is the only token allowed: the best row is ended."""
    ids = range(0, TEST_SENTENCES, 10)
    results = toy.translate(toy.generator(decoder="var-stream", beam=3, min_len=10, max_len_a=0, max_len_b=3,
                                          stream_capacity=4), ids)
    assert sorted(results) == list(ids)
    for hypotheses in results.values():
        (best,) = hypotheses
        assert best["tokens"].numel() == 4 and best["tokens"][-1] == toy.task.target_dictionary.eos()
        assert best["score"] == -math.inf


# ---- refused settings ---------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"delta": math.nan}, "--var-beam-delta must be a number >= 0 or inf, got nan"),  # emptied every hypothesis
    ({"delta": -1.0}, "--var-beam-delta must be a number >= 0 or inf, got -1.0"),
    ({"delta": -math.inf}, "--var-beam-delta must be a number >= 0 or inf, got -inf"),
    ({"max_cands": 0}, "--var-beam-max-cands must be an integer >= 1, got 0"),
])
def test_the_policy_refuses_a_nan_or_negative_delta(settings, message):
    """Checked by the policy itself, for callers that do not go through task.build_generator."""
    from fairseq_fastgen.sequence_generators.var_beam import BeamSearchPolicy

    with pytest.raises(ValueError) as refusal:
        BeamSearchPolicy(5, 1, **{"delta": 1.5, "max_cands": 5, **settings})
    assert str(refusal.value) == message
    assert BeamSearchPolicy(5, 1, delta=math.inf, max_cands=5).delta == math.inf
    assert BeamSearchPolicy(5, 1, delta=0, max_cands=1).delta == 0.0
