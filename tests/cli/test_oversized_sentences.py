"""Issue 30: fairseq-generate with a sentence longer than --max-tokens ended in fairseq's AssertionError
("Sentences lengths should not exceed max_tokens"), translating nothing; like fairseq-interactive, it now
refuses that sentence alone, naming it, and exits with status 1 once the others are translated."""

import re

import pytest

from tests.test_foundation_cli import generate, hypotheses

pytestmark = pytest.mark.xdist_group("toy_cli")

MAX_TOKENS = 24


def over_budget_ids(toy_model):
    """Sentences whose source or target, with eos, is longer than MAX_TOKENS (the toy's words are its tokens)."""
    sources = (toy_model.raw / "test.en").read_text().splitlines()
    targets = (toy_model.raw / "test.fr").read_text().splitlines()
    lengths = [max(len(s.split()), len(t.split())) + 1 for s, t in zip(sources, targets)]
    return [i for i, length in enumerate(lengths) if length > MAX_TOKENS], len(lengths)


def test_fairseq_generate_refuses_a_sentence_over_max_tokens_alone(toy_model):
    refused, total = over_budget_ids(toy_model)
    assert 0 < len(refused) < total
    options = ["--decoder", "greedy", "--beam", "1", "--max-tokens", str(MAX_TOKENS)]
    result = generate(toy_model, *options)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1
    assert sorted(hypotheses(result.stdout)) == sorted(set(range(total)) - set(refused))
    for sentence in refused:
        assert re.search(rf"fairseq-generate: sentence {sentence} has \d+ tokens \(with eos\), more than --max-tokens "
                         rf"{MAX_TOKENS} .*; not translated", result.stderr)
    ids = ", ".join(map(str, refused))
    assert (f"fairseq-generate: {len(refused)} of {total} sentences were too long and not translated (sentence ids "
            f"{ids}); every other sentence was translated") in result.stderr
    # asked to skip such sentences: skipped with a warning, exit 0
    skipped = generate(toy_model, *options, "--skip-invalid-size-inputs-valid-test")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert sorted(hypotheses(skipped.stdout)) == sorted(set(range(total)) - set(refused))
