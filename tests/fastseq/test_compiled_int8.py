"""``--quantize int8 --step-engine compiled``: the compiled units compute the decoder's linear layers on int8 rows
they hold as constants (engine/int8_weights.py).  Within int8 the compiled engine keeps its promises (greedy's
tokens as static int8 gives them, blockwise's exact mode is greedy, var-stream is var-batch);
--int8-library-kernels falls back to static with one line.  bfloat16: test_compiled_bf16.py.

Where two different units meet (the step's against the eager step, the block's against the step's), their float
sums may round apart in the last bit (inductor vectorizes each for the processor), and int8 magnifies that: an
input row's integer can move by one and a near-tie between two tokens go the other way.  Those comparisons allow
it in at most 2% of the sentences (seen: none of 200 on an AMD Zen 5 with AVX-512 VNNI, one on an AMD Zen 3 with
AVX2); a wrong product would change most of them.  Beam search against static int8 allows 5%: there the encoder's
unit differs from the eager encoder too (0.7% of its states' values by more than 1e-4 on a Zen 5, each a moved
integer), and a moved score early in a sentence can send the search down another path (5 of 200 on that Zen 5,
scores moved both ways)."""

import copy
import logging

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import compiled, engine_setting
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.compiled_units import is_encoder
from fairseq_fastgen.engine.int8_weights import Int8Layer, Int8Weights
from fairseq_fastgen.engine.fused_weights import FusedWeightsCache
from fairseq_fastgen.ops import int8_kernel, precision_linear
from fairseq_fastgen.ops.onednn_linear import onednn_available
from fairseq_fastgen.ops.precision_linear import Int8Rows
from tests.fastseq.conftest import LoadedToy, load, shared_test_dir
from tests.engine.test_stock_search import recorded_eager_steps
from tests.fastseq.test_precision_decoding import best_tokens, decode
from tests.float_scores import SAME_BITS_ACROSS_UNITS, assert_same_scores
from tests.models.khead_toy import khead_k2  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.skipif(not int8_kernel.available(), reason="the plugin's int8 kernel does not run here"),
    pytest.mark.skipif(not onednn_available(), reason="units are compiled ahead of time with oneDNN only"),
]


@pytest.fixture(autouse=True)
def every_layer_in_int8(monkeypatch, tmp_path_factory):
    """The toy's weights are all below the size from which int8 pays: here every layer takes the int8 product;
    the units of this file are compiled into a folder of their own, one row bucket (1 row) and the step for more
    rows (each bucket is one more unit to compile, minutes on CI)."""
    monkeypatch.setattr(precision_linear, "MIN_INT8_WEIGHT", 0)
    monkeypatch.setattr(compiled, "FROZEN_MAX_ROWS", 1)
    monkeypatch.setenv("FASTGEN_COMPILED_DIR", str(shared_test_dir(tmp_path_factory, "compiled-int8")))


def assert_tokens_match_up_to_near_ties(got, expected, share=0.02):
    """The best hypotheses' tokens of ``got`` are ``expected``'s for every sentence but at most ``share`` of them
    (near-ties that the units' rounding decides: the module's docstring)."""
    got, expected = best_tokens(got), best_tokens(expected)
    assert sorted(got) == sorted(expected)
    differing = [sentence for sentence in expected if got[sentence] != expected[sentence]]
    assert len(differing) <= share * len(expected), differing


def runner_of(generator) -> CompiledRunner:
    runner = getattr(generator, "runner", None) or generator.model.runner  # a stock search holds it in its ensemble
    assert type(runner) is CompiledRunner
    return runner


def test_the_fused_query_key_value_rows_give_the_three_products_bits(loaded_toy):
    """Each output row's scale is its own and each input row's depends on the input only: the fused product
    of a layer's query, key and value rows is bitwise the three int8 products side by side."""
    decoder = loaded_toy.models[0].decoder
    fused = FusedWeightsCache(decoder).current()
    weights = Int8Weights(decoder, fused.qkv_weights, fused.qkv_biases, float32_vocabulary=False)
    attention = decoder.layers[1].self_attn
    x = torch.randn(7, 3, attention.q_proj.in_features)  # (n, rows, dim)
    apart = [Int8Rows(p.weight.detach())(x, p.bias) for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert torch.equal(weights.qkv_layer(1)(x), torch.cat(apart, dim=-1))
    assert torch.equal(weights.layer("layers.1.fc1")(x), Int8Rows(decoder.layers[1].fc1.weight.detach())(
        x, decoder.layers[1].fc1.bias))
    assert weights.layer("output_projection") is not None
    kept = Int8Weights(decoder, fused.qkv_weights, fused.qkv_biases, float32_vocabulary=True)
    assert kept.layer("output_projection") is None and isinstance(kept.layer("layers.0.fc2"), Int8Layer)


def test_compiled_units_compute_int8_and_give_static_int8s_tokens(loaded_toy, translate):
    """Every step runs a unit compiled ahead of time (the row buckets and the step for more rows), never the
    eager step, and gives the tokens static int8 gives (up to near-ties); the int8 products did change float32's."""
    assert engine_setting(PluginOptions(step_engine="compiled", quantize="int8")) == "compiled"
    static = decode(loaded_toy, translate, 16, decoder="greedy", beam=1, quantize="int8")
    float32 = decode(loaded_toy, translate, 16, decoder="greedy", beam=1)  # static: the compiled engine's tokens
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="greedy", beam=1, quantize="int8", step_engine="compiled"))
    runner = runner_of(generator)
    eager = []
    runner.eager_step = lambda *args: eager.append(args) or pytest.fail("the eager step ran")
    int8 = translate(loaded_toy, generator, 16)
    assert_tokens_match_up_to_near_ties(int8, static)
    assert best_tokens(int8) != best_tokens(float32)
    assert runner.freezing and runner.units.packaged and all(u is not None for u in runner.units.packaged.values())
    assert isinstance(runner.decoder_step.reduced, Int8Weights)
    assert all("forward" not in m.__dict__ for m in loaded_toy.models[0].modules())  # detached after generate


def test_every_unit_reads_the_decodes_own_int8_rows_in_place(loaded_toy, translate):
    """The units are compiled without their constants and read the decode's tensors: every unit holds the same
    int8 rows (one copy however many units), and rows changed in place change what every unit computes."""
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="greedy", beam=1, quantize="int8", step_engine="compiled"))
    runner = runner_of(generator)
    before = best_tokens(translate(loaded_toy, generator, 16))  # the unit for many rows, then 1 row at the end
    units = [unit for key, unit in runner.units.packaged.items() if unit is not None and not is_encoder(key)]
    assert len(units) >= 2
    vocabulary = runner.decoder_step.reduced.layer("output_projection")
    for unit in units:
        held = unit.constants["decoder_step.reduced.layers.output_projection.packed"]
        assert held.data_ptr() == vocabulary.packed.data_ptr()
    scales = vocabulary.scales.clone()
    with torch.inference_mode():  # the rows were made in the decode's inference mode
        vocabulary.scales.zero_()  # every logit 0: the same token wins every step, up to the length limit
    try:
        flat = best_tokens(translate(loaded_toy, generator, 16))
    finally:
        with torch.inference_mode():
            vocabulary.scales.copy_(scales)
    assert all(len(set(tokens[:-1])) == 1 and tokens != before[i] for i, tokens in flat.items())
    assert best_tokens(translate(loaded_toy, generator, 16)) == before


def test_the_encoders_unit_computes_its_layers_in_int8(loaded_toy, translate):
    """Under --quantize int8 the encoder runs its unit too (it ran fairseq's encoder through the stand-ins): the
    unit holds the encoder's int8 rows and its states are the stand-ins' within float rounding, far nearer them
    than float32's states are."""
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="greedy", beam=1, quantize="int8", step_engine="compiled"))
    runner = runner_of(generator)
    translate(loaded_toy, generator, 16)  # batches of 16 and 8 rows: the encoder's unit for more rows than one
    encoder_units = {key: unit for key, unit in runner.units.packaged.items() if is_encoder(key)}
    assert set(encoder_units) == {("encoder", None)} and None not in encoder_units.values()
    assert isinstance(runner.units.encoder_pass.reduced, Int8Weights)
    assert_encoder_unit_is_the_stand_ins(loaded_toy, generator, loaded_toy.models[0])


def test_the_encoders_int8_rows_are_made_from_the_weights_it_encodes_with(loaded_toy):
    """A generator built, then the encoder's weights changed in place (training between validations): the unit's
    int8 rows are made from the changed weights, not from those the generator was built with."""
    model = copy.deepcopy(loaded_toy.models[0])
    generator = loaded_toy.task.build_generator([model], GenerationConfig(
        decoder="greedy", beam=1, quantize="int8", step_engine="compiled"))
    with torch.no_grad():
        model.encoder.layers[0].fc2.weight.mul_(3.0)
    assert_encoder_unit_is_the_stand_ins(loaded_toy, generator, model)


def test_every_layers_encoder_decoder_keys_are_one_int8_product_with_the_stand_ins_bits(loaded_toy):
    """Under int8 a sentence's encoder-decoder keys and values of every layer come from one product of int8 rows
    (two products a layer through --quantize's stand-ins before): bitwise the stand-ins' keys and values, and made
    again from those projections' weights when they change in place."""
    model = copy.deepcopy(loaded_toy.models[0])
    generator = loaded_toy.task.build_generator([model], GenerationConfig(
        decoder="greedy", beam=1, quantize="int8", step_engine="compiled"))
    runner = runner_of(generator)
    batch = loaded_toy.dataset.collater([loaded_toy.dataset[index] for index in range(8)])["net_input"]

    def cached_and_stand_ins():
        """The keys and values a started cache holds, and those of each layer's projections through the
        stand-ins, (rows, heads, src_len, head_dim) each."""
        with torch.inference_mode():
            encoder_out = runner.encode(batch)
            cache = runner.new_cache()
            runner.start_cache(cache, encoder_out)
            states = encoder_out["encoder_out"][0]  # (src_len, rows, dim)
            with generator.linear_forwards[0].attached():
                keys, values = runner.decoder_step.encoder_keys_values(states)
        src_len, rows = states.shape[:2]
        held = [t[:rows, :, :src_len] for t in cache.cross_keys + cache.cross_values]
        return held, keys + values

    held, stand_ins = cached_and_stand_ins()
    layers, dim = len(model.decoder.layers), model.decoder.embed_dim
    assert isinstance(runner.keys_rows, Int8Layer) and runner.keys_rows.out_features == 2 * layers * dim
    assert len(held) == len(stand_ins) == 2 * layers
    assert all(torch.equal(a, b) for a, b in zip(held, stand_ins))
    with torch.no_grad():
        model.decoder.layers[-1].encoder_attn.v_proj.weight.mul_(3.0)
    changed, stand_ins = cached_and_stand_ins()
    assert all(torch.equal(a, b) for a, b in zip(changed, stand_ins))
    assert not torch.equal(changed[-1], held[-1]) and torch.equal(changed[0], held[0])


def assert_encoder_unit_is_the_stand_ins(loaded_toy, generator, model):
    """The encoder's unit gives the states of fairseq's encoder through --quantize's stand-ins within float
    rounding but for the values an input's moved integer reaches, far nearer them than float32's states are on
    average (8 sentences of the test split; on an AMD Zen 5 0.7% of the values differed by more than 1e-4, the
    largest by a fifth of float32's largest difference, the mean difference 0.3% of float32's)."""
    runner = runner_of(generator)
    batch = loaded_toy.dataset.collater([loaded_toy.dataset[index] for index in range(8)])["net_input"]
    with torch.inference_mode():
        unit = runner.encode(batch)
        with generator.linear_forwards[0].attached():  # fairseq's encoder through --quantize's stand-ins
            stand_ins = model.encoder(batch["src_tokens"], batch["src_lengths"])
        float32 = model.encoder(batch["src_tokens"], batch["src_lengths"])
    assert runner.units.packaged.get(("encoder", None)) is not None
    real = ~stand_ins["encoder_padding_mask"][0].t()  # (src_len, rows): the positions a decoder reads
    assert torch.equal(~unit["encoder_padding_mask"][0].t(), real)
    states = [out["encoder_out"][0][real] for out in (unit, stand_ins, float32)]  # (positions, dim) each
    assert (states[0] - states[1]).abs().mean() < 0.02 * (states[2] - states[1]).abs().mean()
    assert ((states[0] - states[1]).abs() > 1e-4).float().mean() < 0.05  # a few moved integers, not most values


def test_beam_search_on_compiled_int8_units(loaded_toy, translate):
    """fairseq's beam search over the compiled engine in int8: its sentences' beams share their keys in the
    unit for many rows, the first step too (the units' rounding, not an eager step's as in float32); the
    hypotheses are static int8's tokens (up to near-ties between the units' rounding)."""
    static = decode(loaded_toy, translate, 16, decoder="beam", beam=4, quantize="int8")
    generator = loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(
        decoder="beam", beam=4, quantize="int8", step_engine="compiled"))
    eager_steps = recorded_eager_steps(runner_of(generator))
    int8 = translate(loaded_toy, generator, 16)
    assert_tokens_match_up_to_near_ties(int8, static, share=0.05)  # the encoder's unit too: the module's docstring
    assert runner_of(generator).units.packaged.get(("beams", 4)) is not None
    assert eager_steps == []


def assert_blockwise_is_greedy_on_compiled(loaded_khead, translate, quantize: str):
    """Blockwise's exact mode gives greedy's tokens on the compiled engine under ``--quantize quantize``."""
    greedy = decode(loaded_khead, translate, 16, decoder="greedy", beam=1, quantize=quantize, step_engine="compiled")
    blockwise = decode(loaded_khead, translate, 16, decoder="blockwise", beam=1, quantize=quantize,
                       step_engine="compiled")
    if quantize == "int8":  # the block's unit against the step's: near-ties may go apart (the module's docstring)
        assert_tokens_match_up_to_near_ties(blockwise, greedy)
    else:
        assert best_tokens(blockwise) == best_tokens(greedy)


def assert_var_stream_is_var_batch_on_compiled(loaded_toy, translate, quantize: str):
    """var-stream gives var-batch's hypotheses, all of them, on the compiled engine under ``--quantize quantize``."""
    batch = decode(loaded_toy, translate, 32, decoder="var-batch", beam=4, quantize=quantize, step_engine="compiled")
    stream = decode(loaded_toy, translate, 32, decoder="var-stream", beam=4, quantize=quantize,
                    step_engine="compiled")
    assert sorted(stream) == sorted(batch)
    for sentence, hypotheses in batch.items():
        assert [h["tokens"].tolist() for h in stream[sentence]] == [h["tokens"].tolist() for h in hypotheses]


def test_blockwise_exact_mode_is_greedy_on_compiled_int8(loaded_khead, translate):
    assert_blockwise_is_greedy_on_compiled(loaded_khead, translate, "int8")


def test_var_stream_is_var_batch_on_compiled_int8(loaded_toy, translate):
    assert_var_stream_is_var_batch_on_compiled(loaded_toy, translate, "int8")


def test_the_library_kernels_fall_back_to_static_with_one_line(loaded_toy, translate, caplog, monkeypatch):
    options, reason = dict(quantize="int8", int8_library_kernels=True), "--int8-library-kernels"
    monkeypatch.setattr("fairseq_fastgen.engine.choice._quantized_fallback_named", [])
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.engine"):
        assert engine_setting(PluginOptions(step_engine="compiled", **options)) == "static"
    lines = [r.getMessage() for r in caplog.records if "runs on --step-engine static" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0]
    fallback = decode(loaded_toy, translate, 16, decoder="greedy", beam=1, step_engine="compiled", **options)
    static = decode(loaded_toy, translate, 16, decoder="greedy", beam=1, **options)
    assert best_tokens(fallback) == best_tokens(static)


@pytest.fixture(scope="module")
def loaded_khead_k2(khead_k2) -> LoadedToy:
    return load(khead_k2.checkpoint, khead_k2.data_bin)


def test_a_blocks_unit_gives_each_position_the_one_position_units_bits(loaded_khead_k2):
    """Blockwise verification in int8 runs a block's positions as rows of one position (engine/block_rows.py), in
    units whose layer norms sum alike at every row count: with head 1 the base output (its log-probabilities
    computed in the block's unit), they are at each position bitwise those the one-row unit gives greedy's step
    there, after rollbacks too.  (With the block's own attention, one softmax over the buffer and the block, or
    with inductor's two-pass norm for a few rows and Welford's for one, several positions differ in the last bits,
    which int8 can turn into another token.)"""
    loaded = loaded_khead_k2
    generator = loaded.task.build_generator(loaded.models, GenerationConfig(
        decoder="blockwise", beam=1, quantize="int8", step_engine="compiled"))
    runner = runner_of(generator)
    assert runner.scores_blocks and runner.decoder_step.blocks_by_position
    sample = loaded.dataset[3]
    eos = loaded.task.target_dictionary.eos()
    prefix = torch.cat([torch.tensor([eos]), sample["target"][:7]]).unsqueeze(0)  # (1, 8): bos and 7 tokens
    assert prefix.size(1) == 8 and eos not in prefix[0, 1:].tolist()
    with torch.inference_mode():
        encoder_out = runner.encode({"src_tokens": sample["source"].unsqueeze(0),
                                     "src_lengths": torch.tensor([sample["source"].numel()])})
        greedy_cache, block_cache = runner.new_cache(), runner.new_cache()
        greedy = [runner.step(prefix[:, :length], encoder_out, greedy_cache)[0][0].clone() for length in range(1, 8)]

        def block(start: int, n: int):  # (n, vocab): positions start .. start + n - 1
            positions = torch.arange(start, start + n).unsqueeze(0)
            return list(runner.step_block_scored(prefix[:, start:start + n], positions, encoder_out, block_cache)[2][0])

        first_only = torch.tensor([[True, False]])
        verified = block(0, 1) + block(1, 2)  # bos, positions 1-2
        runner.keep_accepted(block_cache, first_only)  # 2 rejected
        verified += block(2, 2) + block(4, 2)  # 2-3, 4-5
        runner.keep_accepted(block_cache, first_only)
        verified += block(5, 2)
    units = runner.units.packaged
    assert units.get(("block", 2, 1)) is not None and units.get(1) is not None
    expected = greedy[:3] + greedy[2:6] + greedy[5:7]
    same = [torch.equal(got, want) for got, want in zip(verified, expected)]
    assert len(same) == 9 and all(same), same


def test_blockwise_one_sentence_at_a_time_is_int8_greedy_bit_for_bit(loaded_khead_k2, translate):
    """One sentence a batch (blockwise's use), compiled int8: blockwise's exact mode gives greedy's tokens and
    its scores, bit for bit, for every sentence of the test split, where the processor has AVX-512; with AVX2 only
    the tokens bit for bit and the scores to float32's rounding (inductor's vectorized float sums of the block's
    rows and of one row take other orders there: a sentence in about a hundred differed in its last bits).  (In
    larger batches rows that kept different numbers of positions are left-padded, which moves a row's positions in
    the softmax's vectorized sum: test_blockwise_exact_mode_is_greedy_on_compiled_int8 allows near-ties there.)"""
    options = dict(beam=1, quantize="int8", step_engine="compiled")
    greedy = decode(loaded_khead_k2, translate, 1, decoder="greedy", **options)
    blockwise = decode(loaded_khead_k2, translate, 1, decoder="blockwise", **options)
    assert sorted(blockwise) == sorted(greedy) and len(greedy) >= 100
    for sentence, hypotheses in greedy.items():
        got, expected = blockwise[sentence][0], hypotheses[0]
        assert torch.equal(got["tokens"], expected["tokens"]), sentence
        assert_same_scores(got["positional_scores"], expected["positional_scores"], SAME_BITS_ACROSS_UNITS, sentence)


def test_int8_proposals_read_the_units_own_int8_rows(loaded_khead_k2, translate):
    """--blockwise-int8-proposals on compiled int8: the proposals' vocabulary projection and k-head layer are the
    units' own int8 layers (one copy of the rows), and blockwise still gives greedy's tokens one sentence at a
    time."""
    options = dict(beam=1, quantize="int8", step_engine="compiled")
    greedy = best_tokens(decode(loaded_khead_k2, translate, 1, decoder="greedy", **options))
    generator = loaded_khead_k2.task.build_generator(loaded_khead_k2.models, GenerationConfig(
        decoder="blockwise", blockwise_int8_proposals=True, **options))
    assert best_tokens(translate(loaded_khead_k2, generator, 1)) == greedy
    runner = runner_of(generator)
    layers = runner.decoder_step.reduced
    assert runner.proposer.layers is layers and runner.proposer.output is layers.layer("output_projection")
    assert runner.proposer.fc1 is not None and runner.proposer.fc1 is layers.layer("heads.fc1")
    assert runner.proposer.fc2 is layers.layer("heads.fc2")
