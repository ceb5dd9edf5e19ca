"""``--transposed-linear`` in decoding: every decoder gives the tokens it gives without the option, with
scores within rounding; the layers are detached after ``generate``; misuses are refused.

The toy (64 wide) shows the plumbing (every decoder, the copies really used, detached afterwards); an untrained
model 256 wide, where MKL's sums over a transposed copy differ from its sums over the weight in the last bits,
shows the rounding at work without changing tokens.
"""

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.option_checks import UsageError
from tests.fastseq.test_onednn_decoding import assert_same_tokens_and_close_scores, wide_random_transformer


def decode_all(loaded, translate, batch_size, models=None, **options):
    generator = loaded.task.build_generator(models or loaded.models, GenerationConfig(**options))
    return translate(loaded, generator, batch_size, models=models), generator


@pytest.mark.parametrize("decoder,beam,batch_size,engine", [
    ("beam", 4, 32, "static"), ("greedy", 1, 64, "static"), ("greedy", 1, 16, "fairseq"), ("var-batch", 4, 32, "static"),
    ("greedy-stream", 1, 16, "static"),
])
def test_decoding_with_transposed_weights_gives_the_same_tokens(loaded_toy, translate, decoder, beam, batch_size,
                                                                engine):
    options = dict(decoder=decoder, beam=beam, max_len_b=200, step_engine=engine)
    plain, _ = decode_all(loaded_toy, translate, batch_size, **options)
    transposed, generator = decode_all(loaded_toy, translate, batch_size, transposed_linear=True, **options)
    copies = [f for linears in generator.linear_stand_ins for f in linears.forwards.values() if f.copy is not None]
    assert copies  # the products of 4 rows or more went through the transposed copies
    assert all("forward" not in m.__dict__ for m in loaded_toy.models[0].modules())  # detached after generate
    assert_same_tokens_and_close_scores(transposed, plain)


def test_blockwise_with_transposed_weights_stays_greedy(loaded_khead, translate):
    greedy, _ = decode_all(loaded_khead, translate, 16, decoder="greedy", beam=1, transposed_linear=True)
    blockwise, _ = decode_all(loaded_khead, translate, 16, decoder="blockwise", beam=1, transposed_linear=True)
    assert sorted(blockwise) == sorted(greedy)
    for sentence in greedy:
        assert torch.equal(blockwise[sentence][0]["tokens"], greedy[sentence][0]["tokens"]), sentence


def test_transposed_weights_round_differently_and_keep_the_tokens(loaded_toy, translate):
    model = wide_random_transformer(loaded_toy)
    options = dict(decoder="greedy", beam=1, max_len_a=0, max_len_b=12)  # an untrained model rarely stops
    plain, _ = decode_all(loaded_toy, translate, 8, models=[model], **options)
    transposed, _ = decode_all(loaded_toy, translate, 8, models=[model], transposed_linear=True, **options)
    assert sorted(transposed) == sorted(plain)
    same_tokens = [s for s in plain if torch.equal(transposed[s][0]["tokens"], plain[s][0]["tokens"])]
    bitwise = [s for s in same_tokens
               if torch.equal(transposed[s][0]["positional_scores"], plain[s][0]["positional_scores"])]
    assert len(bitwise) < len(same_tokens)  # the transposed copies' sums did differ from the weights'
    # a token may change only at a near-tie (about 1e-6 apart); none expected in a few hundred decisions
    assert len(same_tokens) >= 0.95 * len(plain)
    for s in same_tokens:
        assert torch.allclose(transposed[s][0]["positional_scores"], plain[s][0]["positional_scores"], atol=1e-4), s


@pytest.mark.parametrize("options,message", [
    (dict(onednn_linear=True), "--onednn-linear and --transposed-linear each choose the linear layers' product"),
    (dict(step_engine="compiled"), "--transposed-linear applies to the eager steps of --step-engine fairseq and"),
])
def test_misuses_are_refused(loaded_toy, options, message):
    with pytest.raises(UsageError, match=message):
        loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(decoder="greedy", beam=1,
                                                                            transposed_linear=True, **options))
