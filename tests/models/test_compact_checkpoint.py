"""benchmarks/compact_checkpoint.py: the copies that carried the Multi30k models to the GPU machine."""

import subprocess
import sys

import torch

import fairseq_fastgen  # noqa: F401  (registers transformer_khead)
from fairseq import checkpoint_utils
from fairseq.models.transformer import TransformerModel
from fairseq_fastgen.models.transformer_khead import KHeadTransformerModel
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "compact_checkpoint.py"


def load_model(checkpoint, data_bin):
    return checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides={"data": str(data_bin)})[0][0]


def compact(toy, dst, *flags):
    subprocess.run([sys.executable, str(SCRIPT), str(toy.checkpoint), str(dst), *flags], check=True)
    return load_model(dst, toy.data_bin)


def test_strip_kheads_gives_the_stock_transformer_under_the_heads(toy_model, khead_k2, tmp_path):
    """The k2 toy froze the toy transformer's parameters under its heads (--freeze-base), so stripping the
    heads must give back exactly that transformer, loaded as a stock one."""
    stock = compact(khead_k2, tmp_path / "stock.pt", "--strip-kheads")
    assert type(stock) is TransformerModel
    expected = load_model(toy_model.checkpoint, toy_model.data_bin).state_dict()
    got = stock.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert torch.load(tmp_path / "stock.pt", weights_only=False)["last_optimizer_state"] is None


def test_half_copy_loads_as_float32_with_rounded_weights(khead_k2, tmp_path):
    rounded = compact(khead_k2, tmp_path / "half.pt", "--half")
    assert isinstance(rounded, KHeadTransformerModel)
    original = load_model(khead_k2.checkpoint, khead_k2.data_bin).state_dict()
    changed = 0
    for name, tensor in rounded.state_dict().items():
        assert tensor.dtype == original[name].dtype, name
        assert torch.equal(tensor, original[name].half().to(tensor.dtype) if tensor.is_floating_point()
                           else original[name]), name
        changed += int(not torch.equal(tensor, original[name]))
    assert changed > 0  # the rounding is real: the copy is a model of its own
    assert (tmp_path / "half.pt").stat().st_size < 0.6 * khead_k2.checkpoint.stat().st_size


INT8_SCRIPT = REPO / "benchmarks" / "int8_transport.py"


def int8_transport(*arguments):
    subprocess.run([sys.executable, str(INT8_SCRIPT), *map(str, arguments)], check=True, capture_output=True)


def test_int8_parts_rebuild_the_rounded_model_and_a_student_on_its_base(khead_k2, toy_model, tmp_path):
    """pack/unpack round every matrix to int8 rows (the error of a weight at most half its row's step), keep
    vectors exact, keep each part under its size, and rebuild a student from its heads' parts on a base."""
    int8_transport("pack", khead_k2.checkpoint, tmp_path, "student", "--part-mib", 0.25)
    parts = sorted(tmp_path.glob("student.part*.pt"))
    assert len(parts) >= 2 and all(part.stat().st_size <= 0.25 * (1 << 20) for part in parts)
    int8_transport("unpack", tmp_path, "student", tmp_path / "student.pt")
    original = load_model(khead_k2.checkpoint, khead_k2.data_bin).state_dict()
    rounded = load_model(tmp_path / "student.pt", khead_k2.data_bin)
    assert isinstance(rounded, KHeadTransformerModel)
    changed = 0
    for name, tensor in rounded.state_dict().items():
        expected = original[name]
        if expected.dim() < 2 or not expected.is_floating_point():
            assert torch.equal(tensor, expected), name
            continue
        rows = expected.reshape(expected.shape[0], -1)
        step = rows.abs().amax(dim=1, keepdim=True) / 127
        assert ((tensor.reshape(rows.shape) - rows).abs() <= step / 2 + 1e-7).all(), name
        changed += int(not torch.equal(tensor, expected))
    assert changed > 0
    # the tied embeddings travelled once, and came back as one tensor
    whole = torch.load(tmp_path / "student.pt", weights_only=False)["model"]
    assert whole["decoder.output_projection.weight"] is whole["decoder.embed_tokens.weight"]

    # the heads alone, rebuilt on the rounded student's own body: the same weights as the whole rounded student
    int8_transport("pack", khead_k2.checkpoint, tmp_path, "heads", "--only-prefix", "decoder.heads.")
    int8_transport("unpack", tmp_path, "heads", tmp_path / "rebuilt.pt", "--base", tmp_path / "student.pt")
    rebuilt = load_model(tmp_path / "rebuilt.pt", khead_k2.data_bin).state_dict()
    for name, tensor in rounded.state_dict().items():
        assert torch.equal(rebuilt[name], tensor), name
