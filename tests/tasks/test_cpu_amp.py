"""``fairseq-train --cpu --amp``: the products of a training step in bfloat16 on a processor that has them,
the weights float32 (fairseq_fastgen/adapters/cpu_amp.py), through fairseq's own Trainer."""

import logging

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.trainer import Trainer

from fairseq_fastgen.adapters import cpu_amp
from fairseq_fastgen.ops import precision_linear
from fastgen_demo import toy

TINY = toy.ToyModelSpec(arch="transformer", layers=1, dim=32, ffn=64, heads=2, max_update=10, warmup=1)


def trainer_for(toy_model, *precision):
    cli = [str(toy_model.data_bin), "--user-dir", toy.PLUGIN_DIR, "--cpu", "--max-tokens", "512",
           "--criterion", "cross_entropy"] + TINY.train_args() + list(precision)
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), cli))
    task = tasks.setup_task(cfg.task)
    task.load_dataset("valid")
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion), task


def one_update(trainer, task):
    """Train on 8 sentences of the toy valid split; the dtypes the decoder's first product gave while it did."""
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(8)])
    seen = []
    hook = trainer.model.decoder.layers[0].fc1.register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
    try:
        trainer.train_step([sample])
    finally:
        hook.remove()
    return seen


@pytest.mark.skipif(not cpu_amp.native_bfloat16(), reason="this processor has no native bfloat16 products")
def test_amp_on_the_cpu_runs_the_products_in_bfloat16_and_keeps_float32_weights(toy_model, monkeypatch):
    monkeypatch.setattr(precision_linear, "bfloat16_rates", lambda: (200.0, 100.0))  # a processor where bfloat16 pays
    torch.manual_seed(0)
    trainer, task = trainer_for(toy_model, "--amp")
    before = trainer.model.decoder.layers[0].fc1.weight.detach().clone()
    assert one_update(trainer, task) == [torch.bfloat16]  # the first update runs at lr 0 (warm-up from 0)
    assert one_update(trainer, task) == [torch.bfloat16]
    weight = trainer.model.decoder.layers[0].fc1.weight
    assert weight.dtype == torch.float32 and not torch.equal(weight.detach(), before)
    assert trainer.get_num_updates() == 2


def test_without_amp_training_stays_float32(toy_model):
    trainer, task = trainer_for(toy_model)
    assert one_update(trainer, task) == [torch.float32]


@pytest.mark.parametrize("native, rates, reason", [
    (False, None, "no native bfloat16"),  # a processor without bfloat16 products
    (True, (155.0, 252.0), "155 against 252 GFLOP/s"),  # an Intel Xeon without AMX's rates: native, but slower
])
def test_where_bfloat16_does_not_pay_training_stays_float32_and_says_why_once(toy_model, monkeypatch, caplog,
                                                                             native, rates, reason):
    monkeypatch.setattr(cpu_amp, "native_bfloat16", lambda: native)
    monkeypatch.setattr(precision_linear, "bfloat16_rates", lambda: rates)
    monkeypatch.setattr(cpu_amp, "_warned", False)
    trainer, task = trainer_for(toy_model, "--amp")
    with caplog.at_level(logging.WARNING, logger=cpu_amp.__name__):
        assert one_update(trainer, task) == [torch.float32]
        assert one_update(trainer, task) == [torch.float32]
    warnings = [record.getMessage() for record in caplog.records if record.name == cpu_amp.__name__]
    assert len(warnings) == 1 and reason in warnings[0]
