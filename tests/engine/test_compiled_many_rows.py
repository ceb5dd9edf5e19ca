"""--compiled-many-rows: what runs the compiled engine's one-position steps above its row buckets.  ``static`` runs
the static engine's step there: its exact form, eager, torch's products (no stand-in attached), reading the compiled
engine's cache (rows padded to the buckets below them, sources padded to SOURCE_BUCKET, a beam-search sentence's
encoder-decoder keys held once), and no unit is built for those rows; ``kernel`` (the default on processors without
AVX-512) the same step with the plugin's float32 kernel's products, on the frozen units' copies of the weights in its
layout where they hold them; ``unit`` runs the step compiled ahead of time for every row count
(test_compiled_engine.py, test_stock_search.py).  Each gives fairseq's tokens, scores within 1e-4.  The preset shapes
of the reference models (``transformer_wmt_en_de``) take the same path in test_preset_shapes.py."""

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import choice
from fairseq_fastgen.engine.choice import compiled_many_rows, compiled_precision, engine_choice
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.ops.f32_rows_linear import F32RowsForward, many_rows_kernel_available
from fairseq_fastgen.ops.linear_forward import has_stand_in
from fairseq_fastgen.ops.onednn_linear import onednn_available
from tests.engine.test_compiled_engine import assert_same_tokens_close_scores
from tests.engine.test_static_engine import SENTENCES, decode, translate_batches
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)


def processor_flags() -> set:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_processor_is_told_apart_by_its_avx512_instructions():
    flags = processor_flags()
    if not flags or os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("no /proc/cpuinfo flags here, or torch's kernels chosen by $ATEN_CPU_CAPABILITY")
    if "avx512f" not in flags:
        assert not choice.avx512_processor()
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert choice.avx512_processor()


@pytest.mark.parametrize("avx512,expected", [(True, "unit"), (False, "kernel")])
def test_auto_runs_the_kernels_step_above_the_buckets_on_processors_without_avx512(monkeypatch, avx512, expected):
    monkeypatch.setattr(choice, "avx512_processor", lambda: avx512)
    assert compiled_many_rows(PluginOptions()) == expected
    assert compiled_many_rows(PluginOptions(step_engine="compiled")) == expected
    for setting in ("unit", "static", "kernel"):  # as given, on either processor
        assert compiled_many_rows(PluginOptions(compiled_many_rows=setting)) == setting


def test_the_kernel_is_refused_where_it_does_not_run(monkeypatch):
    monkeypatch.setattr(choice, "many_rows_kernel_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--compiled-many-rows kernel runs the plugin's float32 kernel for AVX2, "
                                         r"which this machine does not build or run: use static or unit$"):
        engine_choice(PluginOptions(step_engine="compiled", compiled_many_rows="kernel"))
    assert engine_choice(PluginOptions(step_engine="compiled")).engine == "compiled"  # auto: the runner's fallback


def test_auto_keeps_the_units_where_they_compute_int8(monkeypatch):
    monkeypatch.setattr(choice, "avx512_processor", lambda: False)
    options = PluginOptions(quantize="int8", step_engine="compiled")
    if compiled_precision(options) is None:
        pytest.skip("the compiled engine's int8 units do not run here")
    assert compiled_many_rows(options) == "unit"
    for setting in ("static", "kernel"):
        options.compiled_many_rows = setting
        with pytest.raises(ValueError, match=rf"^--compiled-many-rows {setting} runs float32 steps; the compiled "
                                             rf"engine's units compute --quantize int8: leave it out$"):
            engine_choice(options)


@pytest.mark.parametrize("engine", ["static", "fairseq"])
def test_the_option_is_refused_beside_another_engine(engine):
    with pytest.raises(ValueError, match=rf"^--compiled-many-rows applies to --step-engine compiled; "
                                         rf"got --step-engine {engine}$"):
        engine_choice(PluginOptions(step_engine=engine, compiled_many_rows="unit"))
    assert engine_choice(PluginOptions(step_engine=engine)).engine == engine  # auto: no refusal


def record_static_steps(runner: CompiledRunner, monkeypatch) -> list:
    """(rows, the cache's beams sharing a sentence's keys, the stand-in computing the products (None: torch's), the
    positions the cache held) of each call of the decoder step's exact form: the static engine's step."""
    calls, exact = [], runner.decoder_step.exact
    probe = runner.model.decoder.layers[0].fc1

    def recorded(tokens, position_rows, cache, **options):
        stand_in = probe.__dict__["forward"] if has_stand_in(probe) else None
        calls.append((tokens.size(0), cache.beams, stand_in, cache.length))
        return exact(tokens, position_rows, cache, **options)

    monkeypatch.setattr(runner.decoder_step, "exact", recorded)
    return calls


def assert_beams_start_once(calls: list, batch_size: int, beams: int):
    """A beam search's first step of each batch ran one row per sentence (its beams' bos are one), every later step
    all the beams of its sentences, reading keys held once per sentence."""
    first_steps = [(rows, cache_beams) for rows, cache_beams, _, length in calls if length == 0]
    assert first_steps and set(first_steps) == {(batch_size, 1)}
    later = [(rows, cache_beams) for rows, cache_beams, _, length in calls if length > 0]
    assert later and all(rows % beams == 0 and cache_beams == beams for rows, cache_beams in later)


@pytest.mark.parametrize("many_rows", ["static", "kernel"])
@pytest.mark.parametrize("options", [
    dict(decoder="greedy", beam=1),
    dict(decoder="beam", beam=5),
    dict(decoder="var-stream", beam=5, stream_capacity=6, stream_eps=1 / 6),
], ids=["greedy", "stock-beam5", "var-stream-refills"])
def test_the_static_step_above_the_buckets_gives_fairseqs_tokens_and_builds_no_unit(toy, monkeypatch, options,
                                                                                     many_rows):
    if many_rows == "kernel" and not many_rows_kernel_available():
        pytest.skip("the plugin's float32 kernel for AVX2 does not run here")
    ids = SENTENCES[:48]
    _, expected = decode(toy, ids, 16, step_engine="fairseq", **options)
    generator = toy.generator(step_engine="compiled", compiled_many_rows=many_rows, **options)
    runner = generator.model.runner if options["decoder"] == "beam" else generator.runner
    assert type(runner) is CompiledRunner and runner.static_many_rows
    calls = record_static_steps(runner, monkeypatch)
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, 16))
    assert calls and all(rows > runner.max_rows for rows, _, _, _ in calls)
    assert len({rows for rows, _, _, _ in calls}) > 2  # rows finished and left (or were refilled)
    if many_rows == "static":  # torch's products, not oneDNN's
        assert not any(stand_in for _, _, stand_in, _ in calls)
    else:  # the kernel's, on every step above the buckets
        assert all(type(stand_in) is F32RowsForward for _, _, stand_in, _ in calls)
    if options["decoder"] == "beam":  # stock beam search: keys held per sentence, shared by its 5 beams
        assert_beams_start_once(calls, 16, 5)
    else:
        assert {cache_beams for _, cache_beams, _, _ in calls} == {1}
    assert runner.many_rows_step is None
    assert not [key for key in runner.units.packaged if key is None or key[0] == "beams"]


def test_the_kernels_step_reads_the_frozen_units_copies_of_the_weights(toy):
    """--compiled-many-rows kernel with --compiled-freezing: each linear layer the frozen units of a few rows hold in
    the kernel's layout (every one but each self-attention's query, key and value, which they hold fused, and the
    encoder-decoder keys and values, computed once per decode) is read from the units' copy by the step of many
    rows, not packed again; fairseq's tokens at batch 16 (many rows) and 2
    (the units)."""
    if not many_rows_kernel_available() or not onednn_available():
        pytest.skip("the plugin's float32 kernel for AVX2 and the frozen units do not run here")
    ids = SENTENCES[:18]
    _, expected = decode(toy, ids, 16, step_engine="fairseq", decoder="greedy", beam=1)
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_freezing=True,
                              compiled_many_rows="kernel")
    runner = generator.runner
    assert_same_tokens_close_scores(expected, {**translate_batches(toy, generator, ids[:16], 16),
                                               **translate_batches(toy, generator, ids[16:], 2)})
    units_layers = runner.units.few_rows_step.reduced
    names = {id(module): name for name, module in runner.model.decoder.named_modules()}
    shared, own = [], []
    for forward in runner.kernel_linears.forwards.values():
        held = units_layers.layer(names[id(forward.linear)])
        (shared if held is not None else own).append(names[id(forward.linear)])
        if held is not None:
            assert forward.packed is held.weight  # the units' copy itself
    layers = len(runner.model.decoder.layers)
    assert "output_projection" in shared and len(shared) == 5 * layers + 1  # out, enc q, enc out, fc1, fc2; vocab
    own_ones = [f"layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkv"]  # the units': fused
    own_ones += [f"layers.{i}.encoder_attn.{p}_proj" for i in range(layers) for p in "kv"]  # outside the units
    assert sorted(own) == sorted(own_ones)


def test_in_the_background_the_encoder_comes_first_where_the_steps_take_no_unit(toy, tmp_path, monkeypatch):
    """--compile-in-background: where the steps above the row buckets take no unit (--compiled-many-rows static), a
    decode of 8 rows hands the encoder's unit for more rows to the child process at once (with units above the
    buckets, the steps' come first: test_compiled_engine.py), and uses it once stored; fairseq's tokens meanwhile
    and after."""
    if not onednn_available():
        pytest.skip("the encoder is compiled ahead of time on the CPU with oneDNN only")
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(tmp_path))
    ids = SENTENCES[:16]
    _, expected = decode(toy, ids, 8, step_engine="fairseq", decoder="greedy", beam=1)
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compile_in_background=True,
                              compiled_many_rows="static")
    units, encoder = generator.runner.units, ("encoder", None)
    first = translate_batches(toy, generator, ids[:8], 8)
    assert units.background is not None and units.background[0] == encoder
    deadline = time.monotonic() + 600
    while encoder not in units.packaged:  # what the decode's encoder calls poll: the test waits, a decode does not
        assert time.monotonic() < deadline, "the background compilation did not end"
        units.poll_background(encoder)
        time.sleep(0.2)
    unit, calls = units.packaged[encoder], []
    assert unit is not None and len(list(tmp_path.glob("encoder-*.pt2"))) == 1
    units.packaged[encoder] = lambda *inputs: calls.append(inputs[0].size(0)) or unit(*inputs)
    assert_same_tokens_close_scores(expected, {**first, **translate_batches(toy, generator, ids[8:], 8)})
    assert calls == [8] and units.many_rows_unit(1) is None


@pytest.mark.parametrize("batch_size", [1, 8])
def test_with_the_kernel_the_encoder_runs_its_pass_through_the_kernel_and_no_unit(toy, monkeypatch, batch_size):
    """--compiled-many-rows kernel: every batch's encoder runs the encoder's pass eager, each of its linear layers'
    products through the kernel (a batch's source positions its rows), and no encoder unit is built; the states agree
    with fairseq's encoder within float rounding at the real positions, and a decode gives fairseq's tokens."""
    if not many_rows_kernel_available():
        pytest.skip("the plugin's float32 kernel for AVX2 does not run here")
    ids = SENTENCES[:16]
    _, expected = decode(toy, ids, batch_size, step_engine="fairseq", decoder="greedy", beam=1)
    generator = toy.generator(decoder="greedy", beam=1, step_engine="compiled", compiled_many_rows="kernel")
    runner = generator.runner
    assert runner.units.encoder_pass is None and runner.kernel_encoder is not None
    encoder_linears = [m for m in runner.model.encoder.modules() if isinstance(m, nn.Linear)]
    products = []  # (the layer, its input's rows) of each product the kernel ran
    kernel_product = F32RowsForward.product

    def recorded(self, x, packed, bias):
        products.append((self.linear, x.reshape(-1, x.size(-1)).size(0)))
        return kernel_product(self, x, packed, bias)

    monkeypatch.setattr(F32RowsForward, "product", recorded)
    sample = toy.sample(ids[:batch_size])
    with torch.inference_mode():
        encoder_out = runner.encode(sample["net_input"])
        src_tokens = sample["net_input"]["src_tokens"]
        reference = runner.model.encoder(src_tokens, sample["net_input"]["src_lengths"])
    in_encoder = [(linear, rows) for linear, rows in products if any(linear is m for m in encoder_linears)]
    assert len(in_encoder) == len(encoder_linears) == 6 * len(runner.model.encoder.layers)  # q, k, v, out, fc1, fc2
    assert {rows for _, rows in in_encoder} == {src_tokens.numel()}  # every source position a row
    real = ~reference["encoder_padding_mask"][0].t()  # (src_len, rows)
    states, expected_states = encoder_out["encoder_out"][0], reference["encoder_out"][0]
    assert states.shape == expected_states.shape
    torch.testing.assert_close(states[real], expected_states[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(encoder_out["encoder_padding_mask"][0], reference["encoder_padding_mask"][0])
    assert_same_tokens_close_scores(expected, translate_batches(toy, generator, ids, batch_size))
    assert not [key for key in runner.units.packaged if key is not None and key[0] == "encoder"]


def test_with_the_kernel_a_sentences_beams_attend_to_its_keys_in_one_product(toy):
    """--compiled-many-rows kernel: the exact form's beams of a sentence (keys held once per sentence) attend in one
    product per layer; its outputs and weights are the per-beam products' (fairseq's order) within float rounding,
    laid out alike, the padding masked; with static the per-beam products (fairseq's bits) stay."""
    if not many_rows_kernel_available():
        pytest.skip("the plugin's float32 kernel for AVX2 does not run here")
    kernel = toy.generator(decoder="beam", beam=5, step_engine="compiled", compiled_many_rows="kernel").model.runner
    static = toy.generator(decoder="beam", beam=5, step_engine="compiled", compiled_many_rows="static").model.runner
    assert kernel.decoder_step.beams_together and not static.decoder_step.beams_together
    step, sentences, beams, src_len = kernel.decoder_step, 3, 5, 7
    heads, head_dim = step.heads, step.head_dim
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sentences * beams * heads, 1, head_dim, generator=generator)
    keys, values = (torch.randn(sentences * heads, src_len, head_dim, generator=generator) for _ in range(2))
    mask = torch.zeros(sentences, src_len, dtype=torch.bool)
    mask[1, 5:] = True  # the second sentence is shorter
    together, together_weights = step.attend_beams_together(q, keys, values, mask, beams)
    per_beam, per_beam_weights = step.attend_per_beam(q, keys, values, mask, beams)
    assert together.shape == per_beam.shape == (sentences * beams * heads, 1, head_dim)
    assert together_weights.shape == per_beam_weights.shape == (sentences * beams * heads, 1, src_len)
    # float32 rounding of sums of head_dim products of unit-scale values: products blocked otherwise by the BLAS of
    # another processor differ by a few 1e-6 (1.3e-6 on an Intel Xeon without AMX)
    torch.testing.assert_close(together, per_beam, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together_weights, per_beam_weights, rtol=1e-5, atol=1e-5)
    weights = together_weights.view(sentences, beams, heads, src_len)
    assert torch.all(weights[1, :, :, 5:] == 0) and torch.all(weights[0] > 0)
