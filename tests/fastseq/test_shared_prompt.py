"""A language model's prompt decoded once per sentence, its self-attention keys/values shared by the beams.

A tiny random ``transformer_lm`` is built in-process; stock fairseq beam search
and the same beam search with the shared prompt run on copies of it, prompts
passed as ``LanguageModelingTask.inference_step`` passes them (the source
tokens, right-padded, become ``prefix_tokens``).  Tokens must be those of
stock beam search; scores agree within 1e-5, not bitwise (the prompt steps
multiply one row per sentence instead of one per beam, and CPU matrix products
of different row counts round differently: see the module's docstring).
"""

import argparse
import copy
import types

import pytest
import torch
from fairseq import search
from fairseq.data import Dictionary
from fairseq.dataclass import configs
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from fairseq_fastgen import integration
from fairseq_fastgen.fastseq import (
    SharedPromptAttention,
    optimize_stock_generator,
    prompt_cache_bytes,
    share_prompt_cache,
    shares_prompt_cache,
)
from fairseq_fastgen.options import parse_options

EMBED_DIM, HEADS, LAYERS = 32, 4, 2
MAX_LEN = 16  # generated tokens after the prompt at most (the untrained model rarely ends a sentence)
PROMPTS = {  # prompt token ids (the dictionary's symbols start at 4)
    "one": [[10, 11, 12, 13, 14]],
    "three": [[7], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36, 37, 38]],
}


def lm_dictionary() -> Dictionary:
    dictionary = Dictionary()
    for index in range(46):
        dictionary.add_symbol(f"w{index}")
    return dictionary  # 50 symbols with bos, pad, eos, unk


def lm_args(**overrides) -> argparse.Namespace:
    args = argparse.Namespace(
        decoder_layers=LAYERS, decoder_embed_dim=EMBED_DIM, decoder_ffn_embed_dim=64,
        decoder_attention_heads=HEADS, decoder_input_dim=EMBED_DIM, decoder_output_dim=EMBED_DIM,
        share_decoder_input_output_embed=True, tokens_per_sample=128, max_target_positions=None, dropout=0.0,
    )
    vars(args).update(overrides)
    base_lm_architecture(args)
    return args


def random_lm(task, seed, **overrides):
    torch.manual_seed(seed)
    return TransformerLanguageModel.build_model(lm_args(**overrides), task).eval()


def eos_prone_lm(task, seed):
    """A random language model whose eos logit follows its typical output features:
    sentences end after a few tokens, at different steps."""
    model = random_lm(task, seed)
    with torch.no_grad():
        features, _ = model.decoder.extract_features(torch.arange(4, 50).view(2, 23), None)
        model.decoder.output_projection.weight[task.dictionary.eos()] = features.mean(dim=(0, 1)) / 2
    return model


@pytest.fixture(scope="module")
def lm():
    dictionary = lm_dictionary()
    task = LanguageModelingTask(LanguageModelingConfig(tokens_per_sample=128), dictionary)
    return types.SimpleNamespace(task=task, dictionary=dictionary, model=random_lm(task, seed=0))


def prompt_sample(dictionary, prompts):
    """A batch as LanguageModelingTask.build_dataset_for_inference makes it: eos, then the prompt, right-padded."""
    width = 1 + max(len(prompt) for prompt in prompts)
    src_tokens = torch.full((len(prompts), width), dictionary.pad())
    src_tokens[:, 0] = dictionary.eos()
    for row, prompt in enumerate(prompts):
        src_tokens[row, 1 : 1 + len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([1 + len(prompt) for prompt in prompts])
    return {"id": torch.arange(len(prompts)), "net_input": {"src_tokens": src_tokens, "src_lengths": lengths}}


def plain_generator(lm, models, beam, **kwargs):
    return SequenceGenerator(models, lm.dictionary, beam_size=beam, max_len_b=MAX_LEN, **kwargs)


def sharing_generator(lm, models, beam, **kwargs):
    generator = plain_generator(lm, models, beam, **kwargs)
    assert share_prompt_cache(generator)
    return generator


def generate(lm, generator, models, prompts):
    with torch.no_grad():  # the language modeling task turns the source tokens into prefix_tokens
        return lm.task.inference_step(generator, models, prompt_sample(lm.dictionary, prompts))


def assert_stock_tokens_and_close_scores(stock, shared, prompts, hypotheses_hold_prompt=True):
    assert len(shared) == len(stock) == len(prompts)
    for sentence, (expected_hypos, got_hypos) in enumerate(zip(stock, shared)):
        assert len(got_hypos) == len(expected_hypos)
        for rank, (expected, got) in enumerate(zip(expected_hypos, got_hypos)):
            where = f"sentence {sentence}, hypothesis {rank}"
            assert torch.equal(got["tokens"], expected["tokens"]), where
            if hypotheses_hold_prompt:
                assert got["tokens"][: len(prompts[sentence])].tolist() == prompts[sentence], where
            torch.testing.assert_close(got["score"], expected["score"], rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(
                got["positional_scores"], expected["positional_scores"], rtol=0, atol=1e-5, msg=where
            )


@pytest.mark.parametrize("prompts", ["one", "three"])
@pytest.mark.parametrize("beam", [2, 4])
def test_shared_prompt_gives_stock_tokens_and_scores(lm, beam, prompts):
    prompts = PROMPTS[prompts]
    model = copy.deepcopy(lm.model)
    stock = generate(lm, plain_generator(lm, [lm.model], beam), [lm.model], prompts)
    shared = generate(lm, sharing_generator(lm, [model], beam), [model], prompts)
    assert_stock_tokens_and_close_scores(stock, shared, prompts)
    assert {len(hypos) for hypos in shared} == {beam}


def test_shared_prompt_through_the_generator_forward(lm):
    """SequenceGenerator.forward passes the prompt positionally to _generate."""
    prompts = PROMPTS["three"]
    model = copy.deepcopy(lm.model)
    sample = prompt_sample(lm.dictionary, prompts)
    prefix_tokens = sample["net_input"]["src_tokens"][:, 1:]
    stock = plain_generator(lm, [lm.model], 4)(sample, prefix_tokens, bos_token=lm.dictionary.eos())
    shared = sharing_generator(lm, [model], 4)(sample, prefix_tokens, bos_token=lm.dictionary.eos())
    assert_stock_tokens_and_close_scores(stock, shared, prompts)


def test_shared_prompt_with_an_ensemble_and_eight_heads(lm):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    models = [lm.model, random_lm(lm.task, seed=1, decoder_attention_heads=8)]
    stock = generate(lm, plain_generator(lm, models, 4), models, prompts)
    copies = copy.deepcopy(models)
    shared = generate(lm, sharing_generator(lm, copies, 4), copies, prompts)
    assert_stock_tokens_and_close_scores(stock, shared, prompts)


def test_shared_prompt_with_sampling(lm):
    """Sampling draws every beam's prompt token from beam 0's forced distribution: all beams hold the prompt."""
    prompts = PROMPTS["three"]
    model = copy.deepcopy(lm.model)
    options = dict(search_strategy=search.Sampling(lm.dictionary, sampling_topk=8))
    torch.manual_seed(7)
    stock = generate(lm, plain_generator(lm, [lm.model], 4, **options), [lm.model], prompts)
    options = dict(search_strategy=search.Sampling(lm.dictionary, sampling_topk=8))
    torch.manual_seed(7)
    shared = generate(lm, sharing_generator(lm, [model], 4, **options), [model], prompts)
    assert_stock_tokens_and_close_scores(stock, shared, prompts)


def test_prompts_holding_eos(lm):
    """fairseq finalizes a sentence at a forced eos; sharing stops at the first eos of any prompt."""
    prompts = [[5, 2, 7], [9, 10, 11, 2, 12], [13, 14, 15, 16, 17, 18]]
    model = copy.deepcopy(lm.model)
    stock = generate(lm, plain_generator(lm, [lm.model], 4), [lm.model], prompts)
    shared = generate(lm, sharing_generator(lm, [model], 4), [model], prompts)
    assert [hypos[0]["tokens"].tolist() for hypos in stock[:2]] == [[5, 2], [9, 10, 11, 2]]
    assert_stock_tokens_and_close_scores(stock, shared, prompts, hypotheses_hold_prompt=False)


def test_a_batch_without_prompt(lm):
    """No prefix tokens: only the first step (every beam holds bos) is shared."""
    model = copy.deepcopy(lm.model)
    sample = prompt_sample(lm.dictionary, [[]])
    with torch.no_grad():
        stock = plain_generator(lm, [lm.model], 4).generate([lm.model], sample)
        shared = sharing_generator(lm, [model], 4).generate([model], sample)
    assert_stock_tokens_and_close_scores(stock, shared, [[]])


class StepRecorder:
    """Wraps a generator's ensemble.forward_decoder to record, at every step, what the
    first self-attention layer has cached afterwards."""

    def __init__(self, generator):
        self.steps = []
        self.ensemble = generator.model
        forward_decoder = self.ensemble.forward_decoder

        def recording_forward_decoder(tokens, encoder_outs, incremental_states, temperature=1.0):
            result = forward_decoder(tokens, encoder_outs, incremental_states, temperature)
            self.record(tokens, result[0], incremental_states)
            return result

        self.ensemble.forward_decoder = recording_forward_decoder

    def record(self, tokens, lprobs, incremental_states):
        model, state = self.ensemble.models[0], incremental_states[0]
        cached = model.decoder.layers[0].self_attn._get_input_buffer(state)
        prefix = cached.get("prefix_key")
        self.steps.append({
            "beam_rows": tokens.size(0),
            "output_rows": lprobs.size(0),
            "prefix_shape": None if prefix is None else tuple(prefix.shape),
            "prefix_address": None if prefix is None else prefix.data_ptr(),
            "own_shape": tuple(cached["prev_key"].shape),
            "cache_bytes": prompt_cache_bytes(self.ensemble.models, incremental_states),
        })


@pytest.mark.parametrize("beam", [2, 4])
def test_prompt_is_cached_once_per_sentence(lm, beam):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    shortest = 4  # the steps every sentence spends in its prompt: 0..4 read bos and 4 prompt tokens
    model = copy.deepcopy(lm.model)
    stock, shared = plain_generator(lm, [lm.model], beam), sharing_generator(lm, [model], beam)
    stock_steps, shared_steps = StepRecorder(stock).steps, StepRecorder(shared).steps
    generate(lm, stock, [lm.model], prompts)
    generate(lm, shared, [model], prompts)

    sentences, head_dim = len(prompts), EMBED_DIM // HEADS
    for step, record in enumerate(stock_steps[: shortest + 1]):
        assert record["own_shape"] == (sentences * beam, HEADS, step + 1, head_dim)
    for step, record in enumerate(shared_steps[: shortest + 1]):
        # one decoder row per sentence, one output row per beam
        assert record["beam_rows"] == record["output_rows"] == sentences * beam
        assert record["own_shape"] == (sentences, HEADS, step + 1, head_dim) and record["prefix_shape"] is None
    after_prompt = shared_steps[shortest + 1 :]
    assert after_prompt
    for step, record in enumerate(after_prompt, start=shortest + 1):
        remaining = record["beam_rows"] // beam
        assert record["prefix_shape"] == (remaining, HEADS, shortest + 1, head_dim)
        assert record["own_shape"] == (remaining * beam, HEADS, step - shortest, head_dim)
    # beams reorder at every step; the prefix moves only when sentences finish
    for before, after in zip(after_prompt, after_prompt[1:]):
        if after["prefix_shape"] == before["prefix_shape"]:
            assert after["prefix_address"] == before["prefix_address"]

    # bytes: fp32 keys and values of every layer, held per sentence for the shared positions
    def key_value_bytes(rows, positions):
        return LAYERS * 2 * rows * positions * EMBED_DIM * 4

    step = len(after_prompt) // 2 + shortest + 1
    rows = stock_steps[step]["beam_rows"]
    assert rows == shared_steps[step]["beam_rows"] == sentences * beam  # no sentence finished yet
    assert stock_steps[step]["cache_bytes"] == key_value_bytes(rows, step + 1)
    assert shared_steps[step]["cache_bytes"] == (
        key_value_bytes(sentences, shortest + 1) + key_value_bytes(rows, step - shortest)
    )


@pytest.mark.parametrize("beam", [2, 4])
def test_sentences_leaving_the_batch_keep_their_prompt(lm, beam):
    """Finished sentences leave the batch at different steps: the prefix rows follow the remaining sentences."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19], [20], [21, 22]]
    stock_model = eos_prone_lm(lm.task, seed=0)
    model = copy.deepcopy(stock_model)
    stock, shared = plain_generator(lm, [stock_model], beam), sharing_generator(lm, [model], beam)
    stock_steps, shared_steps = StepRecorder(stock).steps, StepRecorder(shared).steps
    expected = generate(lm, stock, [stock_model], prompts)
    assert_stock_tokens_and_close_scores(expected, generate(lm, shared, [model], prompts), prompts)
    remaining = [record["beam_rows"] // beam for record in shared_steps]
    assert remaining == [record["beam_rows"] // beam for record in stock_steps]
    assert len(set(remaining)) >= 3  # the batch shrinks more than once
    for step, record in enumerate(shared_steps):
        if record["prefix_shape"] is not None:  # after the shared steps 0..1 (the shortest prompt: 1 token)
            assert step >= 2 and record["prefix_shape"][:3] == (remaining[step], HEADS, 2)


def test_beam_one_and_other_searches_are_left_stock(lm):
    model = copy.deepcopy(lm.model)
    for generator in (
        plain_generator(lm, [model], 1),
        plain_generator(lm, [model], 4, search_strategy=search.DiverseBeamSearch(lm.dictionary, 2, 0.5)),
    ):
        assert not share_prompt_cache(generator) and not shares_prompt_cache(generator)
    assert all(type(layer.self_attn) is not SharedPromptAttention for layer in model.decoder.layers)


def test_encoder_decoder_models_are_left_stock(lm):
    args = argparse.Namespace(
        encoder_layers=1, decoder_layers=1, encoder_embed_dim=EMBED_DIM, decoder_embed_dim=EMBED_DIM,
        encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, max_source_positions=64, max_target_positions=64,
    )
    base_architecture(args)
    task = types.SimpleNamespace(source_dictionary=lm.dictionary, target_dictionary=lm.dictionary)
    translation_model = TransformerModel.build_model(args, task).eval()
    generator = plain_generator(lm, [translation_model], 4)
    assert not share_prompt_cache(generator) and not shares_prompt_cache(generator)
    assert all(type(layer.self_attn) is not SharedPromptAttention for layer in translation_model.decoder.layers)


def test_other_generators_on_the_same_models_stay_stock(lm):
    """Sharing converts the models' self-attention modules; a generator built without it must not notice."""
    prompts = PROMPTS["three"]
    model = copy.deepcopy(lm.model)
    reference = generate(lm, plain_generator(lm, [model], 4), [model], prompts)
    generate(lm, sharing_generator(lm, [model], 4), [model], prompts)
    assert all(type(layer.self_attn) is SharedPromptAttention for layer in model.decoder.layers)
    plain = plain_generator(lm, [model], 4)
    assert not shares_prompt_cache(plain)
    again = generate(lm, plain, [model], prompts)
    for expected_hypos, got_hypos in zip(reference, again):  # the stock path: bitwise
        for expected, got in zip(expected_hypos, got_hypos):
            assert torch.equal(got["tokens"], expected["tokens"])
            assert torch.equal(got["positional_scores"], expected["positional_scores"])


def test_optimize_stock_generator_follows_the_switch(lm):
    config = configs.GenerationConfig
    on = optimize_stock_generator(plain_generator(lm, [lm.model], 4), parse_options(config(beam=4)).common)
    off = optimize_stock_generator(plain_generator(lm, [lm.model], 4),
                                   parse_options(config(beam=4, no_shared_encoder_cache=True)).common)
    assert shares_prompt_cache(on) and not shares_prompt_cache(off)


def test_hub_interface_shares_unless_switched_off(lm):
    """GeneratorHubInterface.generate on the language model, through the plugin's build_generator."""
    from fairseq.hub_utils import GeneratorHubInterface
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "generation": OmegaConf.structured(configs.GenerationConfig(max_len_b=MAX_LEN)),
        "dataset": OmegaConf.structured(configs.DatasetConfig(batch_size=8)),
        "tokenizer": None,
        "bpe": None,
    })
    hub = GeneratorHubInterface(cfg, lm.task, [copy.deepcopy(lm.model)]).eval()
    prompts = [torch.tensor(prompt) for prompt in PROMPTS["three"]]
    shared = hub.generate(prompts, beam=4)
    assert shares_prompt_cache(integration.generators_built[-1])
    stock = hub.generate(prompts, beam=4, no_shared_encoder_cache=True)
    assert not shares_prompt_cache(integration.generators_built[-1])
    assert_stock_tokens_and_close_scores(stock, shared, PROMPTS["three"])


def test_language_model_inference_dataset_builds_under_numpy_2(lm):
    """fairseq's TokenBlockDataset (eos break mode, the LM's inference dataset) reads np.compat.long,
    which numpy 2 removed; the plugin provides it."""
    import fairseq_fastgen  # noqa: F401  (the plugin's integration)

    dataset = lm.task.build_dataset_for_inference([torch.tensor([10, 11, 12]), torch.tensor([20, 21])], [3, 2])
    sources = [dataset[i]["net_input.src_tokens"].tolist() for i in range(len(dataset))]
    assert len(sources) == 2
    assert sources[0][-3:] == [10, 11, 12] and sources[1][-2:] == [20, 21]
