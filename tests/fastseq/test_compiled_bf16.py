"""``--quantize bf16 --step-engine compiled``: the compiled units compute the decoder's linear layers on bfloat16
weights packed into each unit (engine/bf16_weights.py).  Within the engine in bfloat16 blockwise's exact mode is
greedy and var-stream is var-batch, sentence by sentence.  Against static bf16 (the same arithmetic summed by other
kernels, each output rounded to bfloat16, so a last-bit difference can move a product by a bfloat16 step) nearly
every output is the same: the tests ask for 95%.  A processor without bfloat16 products gets static's refusal."""

import logging

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import compiled, engine_setting
from fairseq_fastgen.engine.bf16_weights import Bf16Layer, Bf16Weights
from fairseq_fastgen.engine.fused_weights import FusedWeightsCache
from fairseq_fastgen.ops.onednn_linear import onednn_available
from fairseq_fastgen.ops.precision_linear import bf16_linear, precision_refusal
from tests.fastseq.conftest import shared_test_dir
from tests.fastseq.test_compiled_int8 import (
    assert_blockwise_is_greedy_on_compiled, assert_var_stream_is_var_batch_on_compiled, runner_of,
)
from tests.fastseq.test_precision_decoding import best_tokens, decode

needs_bf16 = pytest.mark.skipif(precision_refusal("bf16") is not None, reason="no bfloat16 products on this CPU")
pytestmark = pytest.mark.skipif(not onednn_available(), reason="units are compiled ahead of time with oneDNN only")

SAME_AS_STATIC = 0.95  # the share of outputs at least this: the toy gave 200 of 200 (greedy), 199 of 200 (beam 4)


def share_identical(got, expected) -> float:
    assert sorted(got) == sorted(expected)
    return sum(got[s] == expected[s] for s in expected) / len(expected)


@pytest.fixture(autouse=True)
def one_row_bucket(monkeypatch, tmp_path_factory):
    """The units of this file are compiled into a folder of their own, one row bucket (1 row) and the step for more
    rows (each bucket is one more unit to compile, minutes on CI)."""
    monkeypatch.setattr(compiled, "FROZEN_MAX_ROWS", 1)
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(shared_test_dir(tmp_path_factory, "compiled-bf16")))


@needs_bf16
def test_every_layer_but_the_vocabulary_projection_is_bf16_with_statics_product(loaded_toy):
    """The fused query/key/value layer gives the three bf16 products side by side (each output row is its own dot
    product); every other layer the unit calls holds its weight in bfloat16; the vocabulary projection stays
    float32."""
    decoder = loaded_toy.models[0].decoder
    fused = FusedWeightsCache(decoder).current()
    weights = Bf16Weights(decoder, fused.qkv_weights, fused.qkv_biases)
    attention = decoder.layers[1].self_attn
    x = torch.randn(7, 3, attention.q_proj.in_features)  # (n, rows, dim)
    apart = [bf16_linear(x, p.weight.detach().bfloat16(), p.bias) for p in
             (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert (weights.qkv_layer(1)(x) - torch.cat(apart, dim=-1)).abs().max() <= 1e-2
    fc1 = decoder.layers[1].fc1
    assert torch.equal(weights.layer("layers.1.fc1")(x), bf16_linear(x, fc1.weight.detach().bfloat16(), fc1.bias))
    assert weights.layer("output_projection") is None
    assert weights.layer("layers.0.encoder_attn.k_proj") is None  # computed once per decode, eager
    assert all(isinstance(m, Bf16Layer) and m.weight.dtype == torch.bfloat16 for m in weights.layers.values())


@needs_bf16
def test_compiled_units_compute_bf16_and_give_static_bf16s_tokens(loaded_toy, translate):
    """Every step runs a unit compiled ahead of time, never the eager step, and gives static bf16's tokens for nearly
    every sentence; the scores moved off float32's (the bfloat16 products ran) and stay near static bf16's."""
    assert engine_setting(PluginOptions(step_engine="compiled", quantize="bf16")) == "compiled"
    static = decode(loaded_toy, translate, 16, decoder="greedy", beam=1, quantize="bf16")
    float32 = decode(loaded_toy, translate, 16, decoder="greedy", beam=1)
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="greedy", beam=1, quantize="bf16", step_engine="compiled"))
    runner = runner_of(generator)
    runner.eager_step = lambda *args: pytest.fail("the eager step ran")
    bf16 = translate(loaded_toy, generator, 16)
    assert share_identical(best_tokens(bf16), best_tokens(static)) >= SAME_AS_STATIC
    moved = max(abs(float(bf16[s][0]["score"]) - float(float32[s][0]["score"])) for s in bf16)
    assert moved > 1e-3
    near = sorted(abs(float(bf16[s][0]["score"]) - float(static[s][0]["score"])) for s in bf16)
    assert near[len(near) // 2] < moved
    assert runner.freezing and runner.units.packaged and all(u is not None for u in runner.units.packaged.values())
    assert isinstance(runner.decoder_step.reduced, Bf16Weights)
    assert all("forward" not in m.__dict__ for m in loaded_toy.models[0].modules())  # detached after generate


@needs_bf16
def test_beam_search_on_compiled_bf16_units(loaded_toy, translate):
    """fairseq's beam search over the compiled engine in bfloat16 (its sentences' beams sharing their keys in the
    unit for many rows): static bf16's hypotheses for nearly every sentence."""
    static = decode(loaded_toy, translate, 16, decoder="beam", beam=4, quantize="bf16")
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="beam", beam=4, quantize="bf16", step_engine="compiled"))
    bf16 = translate(loaded_toy, generator, 16)
    assert share_identical(best_tokens(bf16), best_tokens(static)) >= SAME_AS_STATIC
    assert runner_of(generator).units.packaged.get(("beams", 4)) is not None


@needs_bf16
def test_blockwise_exact_mode_is_greedy_on_compiled_bf16(loaded_khead, translate):
    assert_blockwise_is_greedy_on_compiled(loaded_khead, translate, "bf16")


@needs_bf16
def test_var_stream_is_var_batch_on_compiled_bf16(loaded_toy, translate):
    assert_var_stream_is_var_batch_on_compiled(loaded_toy, translate, "bf16")


def test_without_bfloat16_products_compiled_runs_static_whose_refusal_names_them(monkeypatch, caplog):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr("fairseq_fastgen.engine.choice._quantized_fallback_named", [])
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        assert engine_setting(PluginOptions(step_engine="compiled", quantize="bf16")) == "static"
    lines = [r.getMessage() for r in caplog.records if "runs on --step-engine static" in r.getMessage()]
    assert len(lines) == 1 and "AVX-512 BF16" in lines[0]
