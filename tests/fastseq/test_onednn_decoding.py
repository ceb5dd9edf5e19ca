"""``--onednn-linear`` in decoding: every decoder gives the tokens it gives without the
option, with scores within rounding (the toy's candidates are far apart compared with
the products' rounding differences), and the layers are detached after ``generate``.
"""

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.ops.onednn_linear import onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def decode_all(loaded, translate, batch_size, **options):
    generator = loaded.task.build_generator(loaded.models, GenerationConfig(**options))
    return translate(loaded, generator, batch_size), generator


@pytest.mark.parametrize("decoder,beam,batch_size", [("beam", 4, 32), ("greedy", 1, 64), ("var-batch", 4, 32)])
def test_decoding_with_onednn_gives_the_same_tokens(loaded_toy, translate, decoder, beam, batch_size):
    options = dict(decoder=decoder, beam=beam, max_len_b=200)
    plain, _ = decode_all(loaded_toy, translate, batch_size, **options)
    onednn, generator = decode_all(loaded_toy, translate, batch_size, onednn_linear=True, **options)
    # oneDNN did compute: the output projection (rows x 64 x vocab) is above the threshold at these batches
    packed = [f for linears in generator.onednn_linears for f in linears.forwards.values() if f.packed is not None]
    assert packed
    assert all("forward" not in m.__dict__ for m in loaded_toy.models[0].modules())  # detached after generate
    assert sorted(onednn) == sorted(plain)
    for sentence, hypotheses in plain.items():
        for expected, got in zip(hypotheses, onednn[sentence]):
            assert torch.equal(got["tokens"], expected["tokens"]), sentence
            assert torch.allclose(got["positional_scores"], expected["positional_scores"], atol=1e-4), sentence


def test_blockwise_with_onednn_stays_greedy(loaded_khead, translate):
    greedy, _ = decode_all(loaded_khead, translate, 16, decoder="greedy", beam=1, onednn_linear=True)
    blockwise, _ = decode_all(loaded_khead, translate, 16, decoder="blockwise", beam=1, onednn_linear=True)
    assert sorted(blockwise) == sorted(greedy)
    for sentence in greedy:
        assert torch.equal(blockwise[sentence][0]["tokens"], greedy[sentence][0]["tokens"]), sentence
