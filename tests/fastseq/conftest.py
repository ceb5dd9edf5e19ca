"""The toy transformer and the toy transformer_khead loaded in-process, with their test split."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.models.khead_toy import khead_k4, one_thread  # noqa: F401  (fixtures)


@dataclass
class LoadedToy:
    models: list
    task: object
    cfg: object

    @property
    def dataset(self):
        return self.task.dataset("test")


def load(checkpoint, data_bin) -> LoadedToy:
    import fairseq_fastgen  # noqa: F401  (plugin installed before fairseq loads the checkpoint)
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data_bin)}
    )
    for model in models:
        model.eval()
    task.load_dataset("test")
    return LoadedToy(models, task, cfg)


def shared_test_dir(tmp_path_factory, name: str) -> Path:
    """A folder of this test run that every pytest-xdist worker shares (their base folders are siblings): units
    compiled there by one worker are loaded by the other, not compiled again (the engine's file lock makes the
    second wait for the first)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def loaded_toy(toy_model) -> LoadedToy:
    return load(toy_model.checkpoint, toy_model.data_bin)


@pytest.fixture(scope="session")
def loaded_khead(khead_k4) -> LoadedToy:
    """The 4-head transformer_khead model of tests/models (warm started from the toy transformer)."""
    return load(khead_k4.checkpoint, khead_k4.data_bin)


@pytest.fixture(scope="session")
def translate():
    return translate_test_split


def translate_test_split(loaded, generator, batch_size, models=None, keep_ids=None):
    """{sentence id: hypotheses} for the test split, decoded in batches of ``batch_size``
    (only the batches holding one of ``keep_ids``, when given)."""
    batches = loaded.task.get_batch_iterator(
        loaded.dataset, max_sentences=batch_size, required_batch_size_multiple=1, disable_iterator_cache=True
    ).next_epoch_itr(shuffle=False)
    results, largest_batch = {}, 0
    for sample in batches:
        ids = sample["id"].tolist()
        largest_batch = max(largest_batch, len(ids))
        if keep_ids is not None and not set(ids) & keep_ids:
            continue
        with torch.no_grad():
            hypos = generator.generate(models or loaded.models, sample)
        results.update(zip(ids, hypos))
    assert largest_batch == batch_size  # fairseq reuses a cached batch iterator unless told not to
    return results


@pytest.fixture(autouse=True)
def decode_on_one_thread(one_thread):
    """Every test here decodes in-process on one torch thread (the machine's cores are shared)."""
    yield
