"""``--quantize int8`` and ``bf16`` in decoding on the toy models: BLEU within 1.0 of float32, and every exactness
promise held within one precision (greedy is stock beam 1, blockwise's exact mode is greedy, var-stream is var-batch,
with a cluster file too); the layers detached after generate.  The compiled engine in int8:
test_compiled_int8.py."""

import pytest
import sacrebleu
import torch
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.ops import int8_kernel, precision_linear
from fairseq_fastgen.ops.precision_linear import PRECISIONS, precision_refusal
from fairseq_fastgen.option_checks import UsageError
from tests.cluster.conftest import full_coverage_file

PRECISION_PARAMS = [pytest.param(p, marks=pytest.mark.skipif(precision_refusal(p) is not None,
                                                               reason=f"no {p} products on this CPU"))
                    for p in PRECISIONS]


@pytest.fixture(autouse=True)
def every_layer_in_int8(monkeypatch):
    """The toy's weights are all below the size from which int8 pays: here every layer takes the int8 product."""
    monkeypatch.setattr(precision_linear, "MIN_INT8_WEIGHT", 0)


def decode(loaded, translate, batch_size, **options):
    generator = loaded.task.build_generator(loaded.models, GenerationConfig(**options))
    return translate(loaded, generator, batch_size)


def best_tokens(outputs):
    return {sentence: hypotheses[0]["tokens"].tolist() for sentence, hypotheses in outputs.items()}


def bleu(loaded, outputs):
    tgt_dict = loaded.task.target_dictionary
    ids = sorted(outputs)
    hypotheses = [tgt_dict.string(outputs[i][0]["tokens"]) for i in ids]
    references = [tgt_dict.string(loaded.dataset[i]["target"]) for i in ids]
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


@pytest.mark.parametrize("precision", PRECISION_PARAMS)
@pytest.mark.parametrize("decoder, beam", [("greedy", 1), ("beam", 5)])
def test_bleu_stays_within_one_point_of_float32(loaded_toy, translate, precision, decoder, beam):
    float32 = decode(loaded_toy, translate, 32, decoder=decoder, beam=beam)
    reduced = decode(loaded_toy, translate, 32, decoder=decoder, beam=beam, quantize=precision)
    assert sorted(reduced) == sorted(float32)
    assert abs(bleu(loaded_toy, reduced) - bleu(loaded_toy, float32)) <= 1.0
    assert best_tokens(reduced) != best_tokens(float32)  # the products did change
    assert all("forward" not in m.__dict__ for m in loaded_toy.models[0].modules())  # detached after generate


@pytest.mark.parametrize("precision", PRECISION_PARAMS)
def test_greedy_is_stock_beam_one_within_the_precision(loaded_toy, translate, precision):
    greedy = decode(loaded_toy, translate, 16, decoder="greedy", beam=1, quantize=precision)
    stock = decode(loaded_toy, translate, 16, decoder="beam", beam=1, quantize=precision, step_engine="fairseq",
                   no_lean_beam_loop=True, no_shared_encoder_cache=True)
    assert best_tokens(greedy) == best_tokens(stock)


@pytest.mark.parametrize("precision", PRECISION_PARAMS)
def test_blockwise_exact_mode_is_greedy_within_the_precision(loaded_khead, translate, precision):
    greedy = decode(loaded_khead, translate, 16, decoder="greedy", beam=1, quantize=precision)
    blockwise = decode(loaded_khead, translate, 16, decoder="blockwise", beam=1, quantize=precision)
    assert best_tokens(blockwise) == best_tokens(greedy)


@pytest.mark.skipif(precision_refusal("int8") is not None, reason="no int8 products on this CPU")
def test_blockwise_at_batch_1_computes_int8_greedys_bits(loaded_khead, translate):
    """In int8 a block's rows are rounded each on its own scale and its positions attend one by one as greedy's
    steps do: every verified position gives greedy's scores bitwise, not only its tokens."""
    keep = set(range(0, 200, 10))
    greedy = translate(loaded_khead, loaded_khead.task.build_generator(
        loaded_khead.models, GenerationConfig(decoder="greedy", beam=1, quantize="int8")), 1, keep_ids=keep)
    blockwise = translate(loaded_khead, loaded_khead.task.build_generator(
        loaded_khead.models, GenerationConfig(decoder="blockwise", beam=1, quantize="int8")), 1, keep_ids=keep)
    assert sorted(blockwise) == sorted(greedy) and len(greedy) >= 10
    for sentence, (best, *_) in greedy.items():
        assert torch.equal(blockwise[sentence][0]["tokens"], best["tokens"]), sentence
        assert torch.equal(blockwise[sentence][0]["positional_scores"], best["positional_scores"]), sentence


@pytest.mark.skipif(precision_refusal("int8") is not None or int8_kernel.processor_refusal() is not None,
                    reason="the plugin's int8 kernel needs AVX-512 VNNI or AVX2")
@pytest.mark.parametrize("decoder, beam, batch_size", [("greedy", 1, 1), ("greedy", 1, 16), ("beam", 5, 16)])
def test_the_plugins_int8_kernel_decodes_the_library_kernels_bits(loaded_toy, translate, decoder, beam, batch_size):
    """Every product of a decode (1 to 80 rows) through the plugin's kernel or through fbgemm's and oneDNN's: the
    same tokens and the same scores, bitwise."""
    keep = set(range(0, 200, 5))
    options = dict(decoder=decoder, beam=beam, quantize="int8")
    own = translate(loaded_toy, loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(**options)),
                    batch_size, keep_ids=keep)
    library = translate(loaded_toy, loaded_toy.task.build_generator(
        loaded_toy.models, GenerationConfig(int8_library_kernels=True, **options)), batch_size, keep_ids=keep)
    assert sorted(own) == sorted(library) and keep <= set(own)
    for sentence, hypotheses in library.items():
        for expected, got in zip(hypotheses, own[sentence]):
            assert torch.equal(got["tokens"], expected["tokens"]), sentence
            assert torch.equal(got["positional_scores"], expected["positional_scores"]), sentence


@pytest.mark.parametrize("precision", PRECISION_PARAMS)
@pytest.mark.parametrize("with_clusters", [False, True])
def test_var_stream_is_var_batch_within_the_precision(loaded_toy, translate, tmp_path, precision, with_clusters):
    options = dict(beam=4, quantize=precision)
    if with_clusters:
        path = tmp_path / "clusters.pt"
        full_coverage_file(loaded_toy.models[0]).save(path)
        options["cluster_projection"] = str(path)
    batch = decode(loaded_toy, translate, 32, decoder="var-batch", **options)
    stream = decode(loaded_toy, translate, 32, decoder="var-stream", **options)
    assert sorted(stream) == sorted(batch)
    for sentence, hypotheses in batch.items():
        for expected, got in zip(hypotheses, stream[sentence]):
            assert got["tokens"].tolist() == expected["tokens"].tolist(), sentence
            assert torch.equal(got["positional_scores"], expected["positional_scores"]), sentence


@pytest.mark.parametrize("options, message", [
    (dict(quantize="int8", onednn_linear=True), "choose one"),
    (dict(float32_vocabulary_projection=True), "applies to --quantize"),
    (dict(int8_library_kernels=True, quantize="bf16"), "applies to --quantize int8"),
])
def test_misuse_is_refused_in_one_line(loaded_toy, options, message):
    with pytest.raises(UsageError, match=message) as refusal:
        loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(decoder="greedy", beam=1, **options))
    assert "\n" not in str(refusal.value)
