"""ModelRunner (engine/fairseq_runner.py) against the toy transformer itself.

The references are the model's own calls, the way fairseq's SequenceGenerator
makes them (``EnsembleModel.forward_decoder``): the decoder's forward with an
incremental state, the temperature divided into the last position's output,
then ``get_normalized_probs``.  Those comparisons are bitwise: the runner makes
the same computations in the same order.  Comparisons with a full-prefix
forward (no cache) or with rows stepped in another batch order are within
1e-5 only: the same values through matrix products of other shapes, which the
CPU kernels may round differently.
"""

import pytest
import torch

from fairseq_fastgen.engine import make_runner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)

SENTENCES = [0, 1, 2, 5]  # sources of three padded widths in one batch
STEPS = 4
CLOSE = dict(atol=1e-5, rtol=0)


def teacher_prefixes(toy, sample):
    """bos followed by the first STEPS reference target tokens of every row: (rows, 1 + STEPS)."""
    eos = toy.task.target_dictionary.eos()
    bos = torch.full((sample["target"].size(0), 1), eos, dtype=torch.long)
    return torch.cat([bos, sample["target"][:, :STEPS]], dim=1)


def fairseq_step(model, prefix, encoder_out, incremental_state, temperature=1.0):
    """fairseq's own step (EnsembleModel.forward_decoder, one model): lprobs and attn of the last position."""
    decoder_out = model.decoder.forward(prefix, encoder_out=encoder_out, incremental_state=incremental_state)
    attn = decoder_out[1]["attn"][0][:, -1, :]
    last = (decoder_out[0][:, -1:, :].div_(temperature), decoder_out[1])
    return model.get_normalized_probs(last, log_probs=True, sample=None)[:, -1, :], attn


def test_encode_is_the_encoders_forward(toy):
    """``encode`` returns the encoder's forward_torchscript output, key by key, bitwise."""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    with torch.no_grad():
        got = ModelRunner(model).encode(sample["net_input"])
        want = model.encoder.forward_torchscript(sample["net_input"])
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key]):
            assert torch.equal(a, b), key
    assert got["encoder_out"][0].shape[:2] == sample["net_input"]["src_tokens"].t().shape


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_steps_are_bitwise_fairseqs_incremental_step(toy, temperature):
    """Step after step on a growing prefix: the lprobs and attention of fairseq's incremental forward."""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    runner = ModelRunner(model, temperature)
    prefixes = teacher_prefixes(toy, sample)
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
        cache, reference_cache = runner.new_cache(), {}
        for length in range(1, prefixes.size(1) + 1):
            lprobs, attn = runner.step(prefixes[:, :length], encoder_out, cache)
            want, want_attn = fairseq_step(model, prefixes[:, :length], encoder_out, reference_cache, temperature)
            assert lprobs.dtype == torch.float32 and lprobs.shape == (len(SENTENCES), len(toy.task.target_dictionary))
            assert torch.equal(lprobs, want), length
            assert torch.equal(attn, want_attn), length


def test_steps_match_the_full_prefix_forward(toy):
    """Without any cache, the decoder over the whole prefix gives the same last-position lprobs
    (within 1e-5: attention over all positions at once is another matrix product than one query's)."""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    runner = ModelRunner(model)
    prefixes = teacher_prefixes(toy, sample)
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
        cache = runner.new_cache()
        for length in range(1, prefixes.size(1) + 1):
            lprobs, _ = runner.step(prefixes[:, :length], encoder_out, cache)
            full = model.decoder.forward(prefixes[:, :length], encoder_out=encoder_out)
            want = model.get_normalized_probs(full, log_probs=True, sample=None)[:, -1, :]
            assert torch.allclose(lprobs, want, **CLOSE), length
            assert torch.equal(lprobs.argmax(dim=1), want.argmax(dim=1)), length


def test_reorder_cache_then_step_is_stepping_the_permuted_rows_from_scratch(toy):
    """Rows permuted across sentences at a constant row count after two steps: the next step equals
    the permuted rows' prefixes stepped from an empty cache.  (fairseq's reorder_incremental_state would
    leave the encoder-decoder keys in place here, and each row would attend to another sentence.)"""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    runner = ModelRunner(model)
    prefixes = teacher_prefixes(toy, sample)
    index = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
        cache = runner.new_cache()
        for length in (1, 2):
            runner.step(prefixes[:, :length], encoder_out, cache)
        before = {key: {name: v.clone() for name, v in buffers.items() if v is not None}
                  for key, buffers in cache.items()}
        runner.reorder_cache(cache, index)
        for key, buffers in before.items():  # every cached tensor, self- and encoder-decoder attention, moved
            for name, value in buffers.items():
                assert torch.equal(cache[key][name], value.index_select(0, index)), (key, name)
        permuted_out = runner.reorder_encoder_out(encoder_out, index)
        lprobs, attn = runner.step(prefixes[index, :3], permuted_out, cache)

        fresh = runner.new_cache()
        for length in (1, 2, 3):
            want, want_attn = runner.step(prefixes[index, :length], permuted_out, fresh)
    assert torch.allclose(lprobs, want, **CLOSE)
    assert torch.allclose(attn, want_attn, **CLOSE)
    assert torch.equal(lprobs.argmax(dim=1), want.argmax(dim=1))


def test_reorder_cache_may_repeat_and_drop_rows(toy):
    """An index that repeats a row and drops another (beam search): each new row is its source row."""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    runner = ModelRunner(model)
    prefixes = teacher_prefixes(toy, sample)
    index = torch.tensor([1, 1, 3])
    with torch.no_grad():
        encoder_out = runner.encode(sample["net_input"])
        cache, unreordered = runner.new_cache(), runner.new_cache()
        runner.step(prefixes[:, :1], encoder_out, cache)
        runner.step(prefixes[:, :1], encoder_out, unreordered)
        full, _ = runner.step(prefixes[:, :2], encoder_out, unreordered)
        runner.reorder_cache(cache, index)
        lprobs, _ = runner.step(prefixes[index, :2], runner.reorder_encoder_out(encoder_out, index), cache)
    assert lprobs.size(0) == 3
    assert torch.allclose(lprobs, full[index], **CLOSE)
    assert torch.equal(lprobs[0], lprobs[1])  # the same row twice, in the same batch: the same bits


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_project_without_normalizing_gives_the_scaled_logits(toy, temperature):
    """``normalize=False``: the output layer's logits divided by the temperature, float; their
    log_softmax is ``project``'s normalized answer."""
    model = toy.models[0]
    runner = ModelRunner(model, temperature)
    features = torch.randn(3, 2, model.decoder.output_embed_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = runner.project(features, normalize=False)
        lprobs = runner.project(features)
        want = model.decoder.output_layer(features) / temperature
    assert logits.dtype == torch.float32 and logits.shape == (3, 2, len(toy.task.target_dictionary))
    assert torch.equal(logits, want)
    assert torch.equal(torch.log_softmax(logits, dim=-1), lprobs)
    assert torch.allclose(lprobs.exp().sum(dim=-1), torch.ones(3, 2), atol=1e-5)


def test_project_uses_the_given_projection(toy):
    """A projection (features, decoder) -> logits replaces the output layer; ``project=`` replaces both."""
    model = toy.models[0]
    vocab = len(toy.task.target_dictionary)
    keep = torch.tensor([4, 7, 9])

    def only_three(features, decoder):
        logits = torch.full(features.shape[:-1] + (vocab,), float("-inf"))
        logits[..., keep] = decoder.output_layer(features)[..., keep]
        return logits

    features = torch.randn(2, 1, model.decoder.output_embed_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        restricted = ModelRunner(model, projection=only_three).project(features)
        full_logits = model.decoder.output_layer(features)
        through_argument = ModelRunner(model).project(features, project=model.decoder.output_layer)
    want = torch.log_softmax(full_logits[..., keep], dim=-1)
    assert torch.allclose(restricted[..., keep], want, **CLOSE)
    assert restricted.isinf().sum() == 2 * (vocab - 3)
    assert torch.equal(through_argument, torch.log_softmax(full_logits, dim=-1))


def test_concat_encoder_out_left_pads_the_narrower_source(toy):
    """Two cohorts of different source widths: the narrower one is left-padded, its added positions
    masked, and a step over the merged rows gives each row its own cohort's lprobs."""
    model = toy.models[0]
    runner = ModelRunner(model)
    wide, narrow = toy.sample([0, 1]), toy.sample([2])
    assert wide["net_input"]["src_tokens"].size(1) > narrow["net_input"]["src_tokens"].size(1)
    eos = toy.task.target_dictionary.eos()
    with torch.no_grad():
        outs = [runner.encode(s["net_input"]) for s in (wide, narrow)]
        merged = runner.concat_encoder_out(outs)
        extra = wide["net_input"]["src_tokens"].size(1) - narrow["net_input"]["src_tokens"].size(1)
        x, mask = merged["encoder_out"][0], merged["encoder_padding_mask"][0]
        assert x.shape == (outs[0]["encoder_out"][0].size(0), 3, x.size(2))
        assert torch.equal(x[:, :2], outs[0]["encoder_out"][0])
        assert torch.equal(x[extra:, 2], outs[1]["encoder_out"][0][:, 0]) and not x[:extra, 2].any()
        assert mask[2, :extra].all() and torch.equal(mask[2, extra:], outs[1]["encoder_padding_mask"][0][0])

        bos = torch.full((3, 1), eos, dtype=torch.long)
        together, _ = runner.step(bos, merged, runner.new_cache())
        apart = torch.cat([runner.step(bos[:2], outs[0], runner.new_cache())[0],
                           runner.step(bos[2:], outs[1], runner.new_cache())[0]])
    assert torch.allclose(together, apart, **CLOSE)


def test_static_engine_steps_are_bitwise_the_model_runners(toy):
    """``make_runner("static", ...)``: on the CPU in fp32 the same lprobs and attention as ModelRunner,
    bitwise, step after step and after a reorder across sentences."""
    model, sample = toy.models[0], toy.sample(SENTENCES)
    reference, static = ModelRunner(model), make_runner("static", model, 1.0, None)
    assert type(static) is not ModelRunner
    prefixes = teacher_prefixes(toy, sample)
    index = torch.tensor([3, 1, 2, 0])
    with torch.no_grad():
        encoder_out = reference.encode(sample["net_input"])
        caches = reference.new_cache(), static.new_cache(1 + STEPS)
        for length in range(1, prefixes.size(1)):
            want, want_attn = reference.step(prefixes[:, :length], encoder_out, caches[0])
            got, got_attn = static.step(prefixes[:, :length], encoder_out, caches[1])
            assert torch.equal(got, want) and torch.equal(got_attn, want_attn), length
        reference.reorder_cache(caches[0], index)
        static.reorder_cache(caches[1], index)
        permuted_out = reference.reorder_encoder_out(encoder_out, index)
        want, want_attn = reference.step(prefixes[index], permuted_out, caches[0])
        got, got_attn = static.step(prefixes[index], permuted_out, caches[1])
    assert torch.equal(got, want) and torch.equal(got_attn, want_attn)
