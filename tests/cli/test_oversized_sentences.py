"""Fairseq-generate with a sentence longer than --max-tokens ended in fairseq's AssertionError
("Sentences lengths should not exceed max_tokens"), translating nothing; like fairseq-interactive, it now
refuses that sentence alone, naming it, and exits with status 1 once the others are translated."""

import re

import pytest

from tests.test_foundation_cli import generate, hypotheses

pytestmark = pytest.mark.xdist_group("test_oversized_sentences")

MAX_TOKENS = 24


def over_budget_ids(toy_model):
    """Sentences whose source or target, with eos, is longer than MAX_TOKENS (the toy's words are its tokens)."""
    sources = (toy_model.raw / "test.en").read_text().splitlines()
    targets = (toy_model.raw / "test.fr").read_text().splitlines()
    lengths = [max(len(s.split()), len(t.split())) + 1 for s, t in zip(sources, targets)]
    return [i for i, length in enumerate(lengths) if length > MAX_TOKENS], len(lengths)


def hypothesis_ids(output):
    """The sentence id of every H- line, in the order printed."""
    return [int(line.split("\t")[0][2:]) for line in output.splitlines() if line.startswith("H-")]


def assert_refused_alone(result, refused, total, option="--max-tokens"):
    """Exit status 1, each sentence of ``refused`` named once in its line, then the one line naming them all;
    every other sentence answered exactly once."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1, result.stderr[-2000:]
    answered = hypothesis_ids(result.stdout)
    assert sorted(answered) == sorted(set(range(total)) - set(refused))  # each once
    named = [int(found) for found in re.findall(rf"^fairseq-generate: sentence (\d+) has \d+ tokens \(with eos\), more "
                                                rf"than {option} {MAX_TOKENS} .*; not translated", result.stderr, re.M)]
    assert named == refused
    ids = ", ".join(map(str, refused))
    assert (f"fairseq-generate: {len(refused)} of {total} sentences were too long and not translated (sentence ids "
            f"{ids}); every other sentence was translated") in result.stderr


def test_fairseq_generate_refuses_a_sentence_over_max_tokens_alone(toy_model):
    refused, total = over_budget_ids(toy_model)
    assert 0 < len(refused) < total
    options = ["--decoder", "greedy", "--beam", "1", "--max-tokens", str(MAX_TOKENS)]
    result = generate(toy_model, *options)
    assert_refused_alone(result, refused, total)
    # asked to skip such sentences: skipped with a warning, exit 0
    skipped = generate(toy_model, *options, "--skip-invalid-size-inputs-valid-test")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert sorted(hypotheses(skipped.stdout)) == sorted(set(range(total)) - set(refused))


@pytest.mark.parametrize("decoder, beam, option", [("greedy-stream", 1, "--max-tokens"),
                                                   ("var-stream", 2, "--stream-capacity-tokens")])
def test_a_streamed_decoder_refuses_the_same_sentences(toy_model, decoder, beam, option):
    """The streamed decoders read --max-tokens (or --stream-capacity-tokens) as their capacity,
    fairseq's batching then has no token limit, and every sentence was translated without a word where greedy
    refused those longer than the limit: one rule for every decoder, in the same words."""
    refused, total = over_budget_ids(toy_model)
    result = generate(toy_model, "--decoder", decoder, "--beam", str(beam), option, str(MAX_TOKENS))
    assert_refused_alone(result, refused, total, option)
