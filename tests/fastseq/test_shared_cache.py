"""Encoder-decoder attention keys/values shared by the beams of a sentence.

Stock fairseq beam search (the optimization off) and the same beam search with
the shared cache run in one process on the same models; every sentence's
hypotheses must be bitwise equal: tokens, scores, positional scores, attention.
"""

import copy

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.sequence_generator import SequenceGenerator

from fairseq_fastgen.adapters.ensemble import restore_ensemble
from fairseq_fastgen.fastseq import (
    SharedEncoderAttention,
    encoder_attention_cache_bytes,
    optimize_stock_generator,
    share_encoder_cache,
    shares_encoder_cache,
)
from fairseq_fastgen.options import parse_options

BATCH_1_IDS = set(range(0, 200, 4))  # batch size 1: every 4th test sentence keeps the test short


def stock_generator(loaded, beam, models=None, max_len_b=200):
    """fairseq's generator with fairseq's own ensemble and decoder calls (what FastSeq's shared cache serves:
    the models no runner serves), the plugin's shared caches and lean loop off."""
    config = GenerationConfig(beam=beam, max_len_b=max_len_b, no_shared_encoder_cache=True, no_lean_beam_loop=True,
                              step_engine="fairseq")
    generator = loaded.task.build_generator(models or loaded.models, config)
    restore_ensemble(generator)  # the runner fairseq's engine gives a single model's beam search
    return generator


def assert_bitwise_equal(stock, shared):
    assert sorted(shared) == sorted(stock)
    for sentence in stock:
        assert len(shared[sentence]) == len(stock[sentence])
        for rank, (expected, got) in enumerate(zip(stock[sentence], shared[sentence])):
            where = f"sentence {sentence}, hypothesis {rank}"
            assert torch.equal(got["tokens"], expected["tokens"]), where
            assert torch.equal(got["score"], expected["score"]), where
            assert torch.equal(got["positional_scores"], expected["positional_scores"]), where
            assert torch.equal(got["attention"], expected["attention"]), where


@pytest.mark.parametrize("batch_size", [1, 32])
@pytest.mark.parametrize("beam", [1, 4, 8])
def test_shared_cache_gives_stock_tokens_and_scores(loaded_toy, translate, beam, batch_size):
    keep = BATCH_1_IDS if batch_size == 1 else None
    stock = translate(loaded_toy, stock_generator(loaded_toy, beam), batch_size, keep_ids=keep)
    generator = stock_generator(loaded_toy, beam)
    assert share_encoder_cache(generator) == (beam > 1)  # one beam has nothing to share
    shared = translate(loaded_toy, generator, batch_size, keep_ids=keep)
    assert len(stock) == (len(BATCH_1_IDS) if keep else 200)
    assert_bitwise_equal(stock, shared)


@pytest.mark.parametrize("beam, batch_size", [(4, 32), (8, 1)])
def test_shared_cache_gives_stock_khead_output(loaded_khead, translate, beam, batch_size):
    """transformer_khead (a TransformerModel subclass) through stock beam search: head 1 only."""
    keep = BATCH_1_IDS if batch_size == 1 else None
    stock = translate(loaded_khead, stock_generator(loaded_khead, beam), batch_size, keep_ids=keep)
    generator = stock_generator(loaded_khead, beam)
    assert share_encoder_cache(generator)
    assert_bitwise_equal(stock, translate(loaded_khead, generator, batch_size, keep_ids=keep))


def random_transformer(loaded, heads, seed):
    """An untrained transformer of the toy's shape with ``heads`` attention heads."""
    model_cfg = copy.deepcopy(loaded.cfg.model)
    model_cfg.encoder_attention_heads = model_cfg.decoder_attention_heads = heads
    torch.manual_seed(seed)
    return loaded.task.build_model(model_cfg).eval()


def test_shared_cache_with_eight_heads_and_an_ensemble(loaded_toy, translate):
    models = [loaded_toy.models[0], random_transformer(loaded_toy, heads=8, seed=3)]
    # the untrained model rarely ends a sentence: 12 tokens at most keep the test short
    stock = translate(loaded_toy, stock_generator(loaded_toy, 4, models, max_len_b=12), 32, models=models)
    generator = stock_generator(loaded_toy, 4, models, max_len_b=12)
    assert share_encoder_cache(generator)
    assert_bitwise_equal(stock, translate(loaded_toy, generator, 32, models=models))


class StepRecorder:
    """Wraps a generator's ensemble.forward_decoder to record, at every step, what the
    decoder sees and what its encoder-decoder caches hold afterwards."""

    def __init__(self, generator):
        self.steps = []
        self.ensemble = generator.model
        forward_decoder = self.ensemble.forward_decoder

        def recording_forward_decoder(tokens, encoder_outs, incremental_states, temperature=1.0):
            result = forward_decoder(tokens, encoder_outs, incremental_states, temperature)
            self.record(tokens, encoder_outs, incremental_states)
            return result

        self.ensemble.forward_decoder = recording_forward_decoder

    def record(self, tokens, encoder_outs, incremental_states):
        model, state = self.ensemble.models[0], incremental_states[0]
        layer_attention = model.decoder.layers[0].encoder_attn
        cached_keys = layer_attention._get_input_buffer(state)["prev_key"]  # (rows, heads, src_len, head_dim)
        self.steps.append({
            "beam_rows": tokens.size(0),
            "encoder_rows": encoder_outs[0]["encoder_out"][0].size(1),
            "cache_rows": cached_keys.size(0),
            "cache_address": cached_keys.data_ptr(),
            "cache_bytes": encoder_attention_cache_bytes(self.ensemble.models, incremental_states),
        })


@pytest.mark.parametrize("beam", [4, 8])
def test_encoder_state_is_held_once_per_sentence(loaded_toy, beam):
    sample = next(iter(loaded_toy.task.get_batch_iterator(
        loaded_toy.dataset, max_sentences=32, required_batch_size_multiple=1, disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=False)))
    stock, shared = stock_generator(loaded_toy, beam), stock_generator(loaded_toy, beam)
    share_encoder_cache(shared)
    stock_steps, shared_steps = StepRecorder(stock).steps, StepRecorder(shared).steps
    with torch.no_grad():
        stock.generate(loaded_toy.models, sample)
        shared.generate(loaded_toy.models, sample)

    sentences = sample["id"].numel()
    assert shared_steps[0]["beam_rows"] == sentences * beam
    for step in shared_steps:  # the beams' rows outnumber the sentences they share
        assert step["encoder_rows"] == step["cache_rows"] == step["beam_rows"] // beam
    for step in stock_steps:
        assert step["encoder_rows"] == step["cache_rows"] == step["beam_rows"]
    # beams reorder at every step; the shared cache moves only when sentences finish
    for before, after in zip(shared_steps, shared_steps[1:]):
        if after["cache_rows"] == before["cache_rows"]:
            assert after["cache_address"] == before["cache_address"]
    assert shared_steps[-1]["cache_rows"] < sentences  # and it does shrink
    # peak memory: the first step, before any sentence finishes
    stock_peak = max(step["cache_bytes"] for step in stock_steps)
    shared_peak = max(step["cache_bytes"] for step in shared_steps)
    src_len = sample["net_input"]["src_tokens"].size(1)
    layers = len(loaded_toy.models[0].decoder.layers)
    embed_dim = loaded_toy.models[0].decoder.embed_dim
    key_value_bytes = 2 * sentences * src_len * embed_dim * 4  # fp32 keys and values of one layer
    padding_bytes = sentences * src_len * 4  # the float padding mask fairseq caches
    assert shared_peak == layers * (key_value_bytes + padding_bytes)
    assert stock_peak == beam * shared_peak


def test_other_generators_on_the_same_models_stay_stock(loaded_toy, translate):
    """Sharing converts the models' attention modules; a generator built without it must not notice."""
    shared = stock_generator(loaded_toy, 4)
    share_encoder_cache(shared)
    reference = translate(loaded_toy, shared, 32)
    attention = loaded_toy.models[0].decoder.layers[0].encoder_attn
    assert isinstance(attention, SharedEncoderAttention) and attention.beam_size == 1
    plain = SequenceGenerator(loaded_toy.models, loaded_toy.task.target_dictionary, beam_size=4)
    assert not shares_encoder_cache(plain)
    assert_bitwise_equal(reference, translate(loaded_toy, plain, 32))


def test_build_generator_shares_unless_switched_off(loaded_toy):
    """On fairseq's step, for an ensemble (which no runner serves), the plugin's build_generator shares by
    default; ``--no-shared-encoder-cache`` keeps stock."""
    config = GenerationConfig(beam=4, step_engine="fairseq")
    ensemble = loaded_toy.models * 2
    assert shares_encoder_cache(loaded_toy.task.build_generator(ensemble, config))
    assert not shares_encoder_cache(stock_generator(loaded_toy, 4, ensemble))


def test_optimize_stock_generator_follows_the_switch(loaded_toy):
    on = optimize_stock_generator(stock_generator(loaded_toy, 4), parse_options(GenerationConfig(beam=4)).common)
    off = optimize_stock_generator(stock_generator(loaded_toy, 4),
                                   parse_options(GenerationConfig(beam=4, no_shared_encoder_cache=True)).common)
    assert shares_encoder_cache(on) and not shares_encoder_cache(off)
