"""engine/fused_weights.py: the compiled step's fused query/key/value and transposed vocabulary weights
equal the decoder's own products within fp32 rounding, and follow the parameters when they change."""

import torch
import torch.nn.functional as F

from fairseq_fastgen.engine.fused_weights import FusedWeightsCache, plain_output_projection
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)


def test_fused_products_equal_the_decoders_own(toy):
    decoder = toy.models[0].decoder
    fused = FusedWeightsCache(decoder).current()
    assert len(fused.qkv_weights) == len(decoder.layers)
    x = torch.randn(1, 5, decoder.embed_dim)  # (1, rows, dim)
    for layer, weight, bias in zip(decoder.layers, fused.qkv_weights, fused.qkv_biases):
        attention = layer.self_attn
        q, k, v = F.linear(x, weight, bias).chunk(3, dim=-1)
        for got, projection in ((q, attention.q_proj), (k, attention.k_proj), (v, attention.v_proj)):
            torch.testing.assert_close(got, projection(x), rtol=1e-6, atol=1e-6)
    features = torch.randn(5, 1, decoder.embed_dim)
    assert fused.output_t.is_contiguous() and fused.output_t.shape == (decoder.embed_dim, len(toy.task.target_dictionary))
    torch.testing.assert_close(torch.matmul(features, fused.output_t), decoder.output_layer(features), rtol=1e-5, atol=1e-5)


def test_fused_weights_follow_a_changed_parameter(toy):
    decoder = toy.models[0].decoder
    cache = FusedWeightsCache(decoder)
    first = cache.current()
    assert cache.current() is first  # nothing changed: nothing rebuilt
    key_weight = decoder.layers[1].self_attn.k_proj.weight
    dim = key_weight.size(0)
    with torch.no_grad():
        key_weight.add_(1.0)  # an optimizer step in place
    try:
        second = cache.current()
        assert second is not first
        assert torch.equal(second.qkv_weights[1][dim: 2 * dim], key_weight)
        assert torch.equal(second.qkv_weights[0], first.qkv_weights[0])
    finally:
        with torch.no_grad():
            key_weight.sub_(1.0)


def test_an_output_layer_of_its_own_keeps_the_decoders_projection(toy):
    decoder = toy.models[0].decoder
    assert plain_output_projection(decoder) is decoder.output_projection

    class OwnOutputLayer(type(decoder)):
        def output_layer(self, features):
            return super().output_layer(features) * 2

    original = type(decoder)
    decoder.__class__ = OwnOutputLayer
    try:
        assert plain_output_projection(decoder) is None
        assert FusedWeightsCache(decoder).current().output_t is None
    finally:
        decoder.__class__ = original
