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
