"""Generation under ``torch.inference_mode`` (the default) against ``--no-inference-mode``
(``torch.no_grad``, as stock fairseq): the same kernels, so every decoder gives bitwise the
same hypotheses, returned as ordinary tensors (fairseq-generate writes into them)."""

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

HYPOTHESIS_TENSORS = ("tokens", "score", "positional_scores", "attention")


def decode_all(loaded, translate, batch_size, **options):
    generator = loaded.task.build_generator(loaded.models, GenerationConfig(**options))
    return translate(loaded, generator, batch_size)


@pytest.mark.parametrize("decoder,beam,batch_size", [
    ("beam", 4, 32), ("greedy", 1, 64), ("var-batch", 4, 32), ("var-stream", 4, 32),
])
def test_inference_mode_gives_bitwise_the_same_hypotheses(loaded_toy, translate, decoder, beam, batch_size):
    options = dict(decoder=decoder, beam=beam, max_len_b=200, no_repeat_ngram_size=2)
    fast = decode_all(loaded_toy, translate, batch_size, **options)
    plain = decode_all(loaded_toy, translate, batch_size, no_inference_mode=True, **options)
    assert sorted(fast) == sorted(plain) and len(plain) == len(loaded_toy.dataset)
    for sentence, hypotheses in plain.items():
        assert len(fast[sentence]) == len(hypotheses), sentence
        for expected, got in zip(hypotheses, fast[sentence]):
            for key in HYPOTHESIS_TENSORS:
                if expected.get(key) is not None:
                    assert torch.equal(got[key], expected[key]), (sentence, key)


def test_blockwise_in_inference_mode_is_bitwise_blockwise_and_stays_greedy(loaded_khead, translate):
    greedy = decode_all(loaded_khead, translate, 5, decoder="greedy", beam=1)
    plain = decode_all(loaded_khead, translate, 5, decoder="blockwise", beam=1, no_inference_mode=True)
    fast = decode_all(loaded_khead, translate, 5, decoder="blockwise", beam=1)
    assert sorted(fast) == sorted(plain) == sorted(greedy)
    for sentence, (expected,) in plain.items():
        got = fast[sentence][0]
        for key in HYPOTHESIS_TENSORS:
            if expected.get(key) is not None:
                assert torch.equal(got[key], expected[key]), (sentence, key)
        assert torch.equal(got["tokens"], greedy[sentence][0]["tokens"]), sentence


def test_generate_runs_in_inference_mode_and_returns_writable_tensors(loaded_toy, translate, monkeypatch):
    """The decoder runs in inference mode (unless --no-inference-mode); what it returns can be
    written in place outside it, as fairseq-generate does to the positional scores."""
    from fairseq_fastgen.sequence_generators.greedy import GreedyPolicy

    modes = []
    advance = GreedyPolicy.advance

    def recording_advance(self, *args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return advance(self, *args, **kwargs)

    monkeypatch.setattr(GreedyPolicy, "advance", recording_advance)
    for no_inference_mode in (False, True):
        modes.clear()
        hypotheses = decode_all(loaded_toy, translate, 16, decoder="greedy", beam=1,
                                no_inference_mode=no_inference_mode)
        assert modes and set(modes) == {not no_inference_mode}
        for sentence_hypotheses in hypotheses.values():
            for hypothesis in sentence_hypotheses:
                assert not any(hypothesis[key].is_inference() for key in HYPOTHESIS_TENSORS
                               if hypothesis.get(key) is not None)
                hypothesis["positional_scores"].div_(2.0)  # what fairseq-generate does (to base 2)
