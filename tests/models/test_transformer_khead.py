"""transformer_khead: p_1 everywhere fairseq looks, every head in the extra dict,
multi-position incremental decoding with rollback, warm start and frozen base."""

import random
import re

import pytest
import torch
from torch.nn import functional as F

import fairseq_fastgen  # noqa: F401  (registers the model)
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import GenerationConfig
from omegaconf import OmegaConf
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerDecoderBase
from fairseq_fastgen.models.transformer_khead import KHeadTransformerModel
from fairseq_fastgen.options import parse_options
from fairseq_fastgen.sequence_generators.greedy import GreedyGenerator
from fastgen_demo import toy
from tests.models.khead_toy import build_in_process, randomized_heads

BLOCK = 3

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(toy_model):
    """An untrained 3-head model of the toy dimensions, head layer randomized."""
    return randomized_heads(toy_model.data_bin, BLOCK)


def random_batch(task, rows=4, src_len=7, tgt_len=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    first = task.target_dictionary.nspecial
    src = torch.randint(first, len(task.source_dictionary), (rows, src_len), generator=generator)
    src[:, -1] = task.source_dictionary.eos()
    prev = torch.randint(first, len(task.target_dictionary), (rows, tgt_len), generator=generator)
    prev[:, 0] = task.target_dictionary.eos()  # decoding starts from eos
    return src, torch.full((rows,), src_len), prev


def base_features(decoder, prev, encoder_out):
    """The stock transformer decoder output, before the k-head layer."""
    return TransformerDecoderBase.extract_features(decoder, prev, encoder_out)[0]


@torch.no_grad()
def test_forward_gives_head_one_and_every_head(tiny):
    model, task = tiny
    src, lengths, prev = random_batch(task)
    logits, extra = model(src, lengths, prev)
    heads = model.decoder.output_layer(extra["khead_features"])  # (rows, len, k, vocab)
    assert heads.shape == (4, 9, BLOCK, len(task.target_dictionary))
    assert torch.equal(logits, heads[:, :, 0])

    # head i = output projection of (x + slice i of fc2(relu(fc1(x)))), computed here by hand
    decoder = model.decoder
    x = base_features(decoder, prev, model.encoder(src, lengths))  # (rows, len, dim)
    offsets = F.linear(F.relu(F.linear(x, decoder.heads.fc1.weight, decoder.heads.fc1.bias)),
                       decoder.heads.fc2.weight, decoder.heads.fc2.bias)
    expected = x.unsqueeze(2) + offsets.view(4, 9, BLOCK, -1)
    assert torch.allclose(heads, decoder.output_layer(expected), atol=1e-5)

    # what stock generators and the plugin's runner call: extract_features / incremental forward -> p_1
    encoder_out = model.encoder(src, lengths)
    features, _ = decoder.extract_features(prev, encoder_out)
    assert torch.allclose(decoder.output_layer(features), logits, atol=1e-5)
    step_logits, _ = decoder(prev[:, :1], encoder_out, incremental_state={})
    assert torch.allclose(step_logits[:, 0], logits[:, 0], atol=1e-5)
    assert torch.allclose(model.get_normalized_probs((logits, extra), log_probs=True),
                          torch.log_softmax(heads[:, :, 0], dim=-1), atol=1e-5)


@torch.no_grad()
def test_heads_start_as_the_base_prediction_and_identity_first_keeps_it(toy_model):
    model, task = build_in_process(toy_model.data_bin, "--block-size", "4")
    src, lengths, prev = random_batch(task, seed=1)
    heads = model.decoder.output_layer(model(src, lengths, prev)[1]["khead_features"])
    for head in range(1, 4):  # fc2 starts at zero: every head is the base output
        assert torch.equal(heads[:, :, head], heads[:, :, 0])

    identity, _ = build_in_process(toy_model.data_bin, "--block-size", "4", "--khead-identity-first")
    assert identity.decoder.heads.fc2.out_features == 3 * identity.decoder.output_embed_dim
    torch.nn.init.normal_(identity.decoder.heads.fc2.weight)
    logits, extra = identity(src, lengths, prev)
    x = base_features(identity.decoder, prev, identity.encoder(src, lengths))
    heads = identity.decoder.output_layer(extra["khead_features"])
    assert torch.equal(heads[:, :, 0], identity.decoder.output_layer(x.unsqueeze(2))[:, :, 0])
    assert not torch.allclose(heads[:, :, 1], logits, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("same_take", [False, True])
def test_forward_block_with_rollback_equals_full_forward(tiny, same_take):
    """Rows accept different numbers of tokens per pass (or, with ``same_take``, all
    rows the same number: the rollback's slicing path); rejected positions are rolled
    back, and the accepted positions' features equal the full teacher-forced pass."""
    model, task = tiny
    decoder = model.decoder
    rows, length, n = 4, 12, BLOCK
    src, lengths, prev = random_batch(task, rows=rows, tgt_len=length, seed=2)
    encoder_out = model.encoder(src, lengths)
    expected = base_features(decoder, prev, encoder_out)  # (rows, length, dim)

    cache, pick = {}, random.Random(0)
    got = torch.zeros_like(expected)
    x, attn = decoder.forward_block(prev[:, :1], torch.zeros(rows, 1, dtype=torch.long), encoder_out, cache)
    got[:, 0] = x[:, 0]
    assert attn.shape == (rows, 1, src.size(1))
    done = [1] * rows  # positions of each row in the cache
    junk = len(task.target_dictionary) - 1
    while min(done) < length:
        block = torch.full((rows, n), junk)
        same = pick.randint(1, n)
        take = [min(same if same_take else pick.randint(1, n), length - d) for d in done]  # 0: finished row
        for row in range(rows):
            block[row, : take[row]] = prev[row, done[row]: done[row] + take[row]]
        positions = torch.tensor(done).unsqueeze(1) + torch.arange(n)
        x, _ = decoder.forward_block(block, positions.clamp(max=length - 1), encoder_out, cache)
        for row in range(rows):
            got[row, done[row]: done[row] + take[row]] = x[row, : take[row]]
        decoder.rollback(cache, torch.arange(n).unsqueeze(0) < torch.tensor(take).unsqueeze(1))
        done = [d + t for d, t in zip(done, take)]
        assert decoder.cached_length(cache) == max(done)  # only accepted positions are kept
    assert torch.allclose(got, expected, atol=1e-5)


def load(checkpoint, data_bin):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data_bin)}
    )
    task.load_dataset("test")
    return models[0].eval(), task


def greedy_outputs(model, task, gen_cfg):
    return outputs_of(GreedyGenerator.build(model, task.target_dictionary, gen_cfg, parse_options(gen_cfg)), model, task)


def outputs_of(generator, model, task):
    """{sentence id: (tokens, positional scores)} of the best hypothesis of each test sentence."""
    batches = task.get_batch_iterator(
        dataset=task.dataset("test"), max_sentences=64, disable_iterator_cache=True
    ).next_epoch_itr(shuffle=False)
    outputs = {}
    for sample in batches:
        for sentence, hyps in zip(sample["id"].tolist(), generator.generate([model], sample)):
            outputs[sentence] = (hyps[0]["tokens"].tolist(), hyps[0]["positional_scores"].tolist())
    return outputs


def test_base_checkpoint_with_identity_first_reproduces_the_base_greedy_output(toy_model):
    khead, _ = build_in_process(toy_model.data_bin, "--block-size", "4", "--khead-identity-first",
                                "--base-checkpoint", str(toy_model.checkpoint))
    base, task = load(toy_model.checkpoint, toy_model.data_bin)
    gen_cfg = GenerationConfig(beam=1)
    expected = greedy_outputs(base, task, gen_cfg)
    got = greedy_outputs(khead, task, gen_cfg)
    assert len(expected) == 200
    assert got == expected  # tokens and scores, sentence by sentence, before any training


def test_stock_beam_search_decodes_with_head_one(toy_model, khead_k2):
    """The k2 toy's head 1 is the toy transformer's output (--khead-identity-first).

    Scores agree to the last bits only: its base parameters are frozen, and torch's
    matmul of a 3-D input takes another path when the weight does not require grad.
    """
    gen_cfg = GenerationConfig(beam=4, decoder="beam")
    base, task = load(toy_model.checkpoint, toy_model.data_bin)
    khead, khead_task = load(khead_k2.checkpoint, khead_k2.data_bin)
    expected = outputs_of(task.build_generator([base], gen_cfg), base, task)
    got = outputs_of(khead_task.build_generator([khead], gen_cfg), khead, khead_task)
    assert {s: tokens for s, (tokens, _) in got.items()} == {s: tokens for s, (tokens, _) in expected.items()}
    for sentence, (_, scores) in expected.items():
        assert got[sentence][1] == pytest.approx(scores, abs=1e-5)


def test_base_checkpoint_of_other_dimensions_is_refused(toy_model):
    spec = toy.ToyModelSpec(arch="transformer_khead", layers=3)
    with pytest.raises(ValueError, match=r"--encoder-layers \(checkpoint: 2, this model: 3\).*--decoder-layers"):
        build_in_process(toy_model.data_bin, "--base-checkpoint", str(toy_model.checkpoint), spec=spec)


def test_block_size_must_be_positive(toy_model):
    with pytest.raises(ValueError, match="--block-size must be >= 1"):
        build_in_process(toy_model.data_bin, "--block-size", "0")


def test_khead_ffn_dim_sets_the_head_layers_width_and_blockwise_stays_greedy(toy_model):
    """--khead-ffn-dim: the k-head layer's hidden layer is block size x that wide (default: the decoder's ffn
    width); a narrow layer's random proposals still leave blockwise's exact mode with greedy's tokens."""
    narrow, task = build_in_process(toy_model.data_bin, "--block-size", "3", "--khead-identity-first",
                                    "--khead-ffn-dim", "16", "--base-checkpoint", str(toy_model.checkpoint))
    wide, _ = build_in_process(toy_model.data_bin, "--block-size", "3")
    dim, ffn = narrow.decoder.output_embed_dim, wide.args.decoder_ffn_embed_dim
    assert narrow.decoder.heads.fc1.weight.shape == (3 * 16, dim)
    assert narrow.decoder.heads.fc2.weight.shape == (2 * dim, 3 * 16)  # identity first: heads 2 and 3 learned
    assert wide.decoder.heads.fc1.weight.shape == (3 * ffn, dim) and ffn != 16
    torch.manual_seed(0)
    torch.nn.init.normal_(narrow.decoder.heads.fc2.weight, std=0.1)
    task.load_dataset("test")
    blockwise = outputs_of(task.build_generator([narrow], GenerationConfig(decoder="blockwise", beam=1)), narrow, task)
    greedy = outputs_of(task.build_generator([narrow], GenerationConfig(decoder="greedy", beam=1)), narrow, task)
    assert len(greedy) == 200
    assert {s: tokens for s, (tokens, _) in blockwise.items()} == {s: tokens for s, (tokens, _) in greedy.items()}
    with pytest.raises(ValueError, match="--khead-ffn-dim must be >= 1, got 0"):
        build_in_process(toy_model.data_bin, "--khead-ffn-dim", "0")


def test_freeze_base_trains_only_the_head_layer(toy_model, khead_k2):
    model, _ = build_in_process(toy_model.data_bin, "--freeze-base")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"decoder.heads.fc1.weight", "decoder.heads.fc1.bias",
                         "decoder.heads.fc2.weight", "decoder.heads.fc2.bias"}

    # the k2 toy was trained by fairseq-train with --freeze-base from the toy transformer
    base = checkpoint_utils.load_checkpoint_to_cpu(str(toy_model.checkpoint))["model"]
    trained = checkpoint_utils.load_checkpoint_to_cpu(str(khead_k2.checkpoint))["model"]
    changed = [key for key in base if not torch.equal(base[key], trained[key])]
    assert changed == []
    assert trained["decoder.heads.fc2.weight"].abs().sum() > 0  # the head layer did train


def test_a_frozen_base_multiplies_a_steps_rows_as_its_base_does_once_prepared_for_inference(toy_model, khead_k2):
    """fairseq-generate, -interactive and the hub interface prepare a model for inference: a frozen base's parameters
    (--freeze-base) then need a gradient again, so a step's transposed (rows, 1, dim) features go through the
    vocabulary projection as one matrix, in the base transformer's own sums (exact blockwise verifies with them);
    frozen, torch multiplied them row by row, in other sums."""
    data = {"data": str(toy_model.data_bin)}
    (student,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(khead_k2.checkpoint)], arg_overrides=data)
    (base,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(toy_model.checkpoint)], arg_overrides=data)
    assert not student.decoder.output_projection.weight.requires_grad
    torch.manual_seed(0)
    features = torch.randn(1, 64, student.decoder.output_embed_dim).transpose(0, 1)  # (rows, 1, dim), a step's
    with torch.no_grad():
        expected = base.decoder.output_layer(features)
        frozen = student.decoder.output_layer(features)
        student.prepare_for_inference_(OmegaConf.create({"generation": {"beam": 1}}))
        prepared = student.decoder.output_layer(features)
    assert not torch.equal(frozen, expected)  # row by row: other sums
    assert all(parameter.requires_grad for parameter in student.parameters())
    assert torch.equal(prepared, expected)


def validation_losses(train_log):
    """[{metric: value}] of every validation in a fairseq-train log."""
    rows = []
    for line in train_log.read_text().splitlines():
        if "valid on 'valid' subset" in line:
            rows.append({key: float(value) for key, value in re.findall(r"\| (\w+) ([-\d.]+)", line)})
    return rows


def test_training_decreases_every_heads_validation_loss(two_ranks):
    """fairseq-train with random_subloss from scratch, validated after each of 2 epochs."""
    validations = validation_losses(two_ranks / "rank0.log")
    assert len(validations) == 2
    first, last = validations
    for head in range(1, 5):
        assert last[f"loss_h{head}"] < first[f"loss_h{head}"], (head, first, last)
        assert f"acc_h{head}" in last


def test_two_process_data_parallel_training_keeps_the_ranks_identical(two_ranks):
    saved = checkpoint_utils.load_checkpoint_to_cpu(str(two_ranks / "checkpoint_last.pt"))
    assert saved["cfg"]["distributed_training"]["distributed_world_size"] == 2
    assert saved["cfg"]["distributed_training"]["distributed_backend"] == "gloo"
    ranks = [torch.load(two_ranks / f"rank{rank}.pt") for rank in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == sorted(saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(ranks[0][name], value) and torch.equal(ranks[1][name], value), name
    assert saved["model"]["decoder.heads.fc2.weight"].abs().sum() > 0  # trained


def test_presets_inherit_the_stock_transformer_presets():
    from argparse import Namespace

    assert ARCH_MODEL_REGISTRY["transformer_khead_wmt_en_de"] is KHeadTransformerModel
    args = Namespace()
    ARCH_CONFIG_REGISTRY["transformer_khead_iwslt_de_en"](args)
    stock = Namespace()
    ARCH_CONFIG_REGISTRY["transformer_iwslt_de_en"](stock)
    assert {k: v for k, v in vars(args).items() if k in vars(stock)} == vars(stock)
    khead_options = (args.block_size, args.khead_identity_first, args.freeze_base, args.base_checkpoint)
    assert khead_options == (4, False, False, None)
