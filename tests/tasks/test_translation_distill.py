"""The translation_distill task.

Its "distilled" data-bin here is a stand-in whose targets are the toy valid
targets reversed, so that every loaded pair shows where it came from.  Training
through fairseq-train on a real distilled data-bin: tests/distill/test_distill_cli.py."""

import shutil

import pytest
import torch

from fairseq.data import Dictionary, indexed_dataset
from fairseq_fastgen.tasks.translation_distill import TranslationDistillConfig, TranslationDistillTask
from tests.distill.distill_runs import read_tokens

TRAIN = "valid"  # the toy valid split plays the training split: small
OTHER = "test"


def reversed_target(tokens):
    return tokens[-2::-1] + tokens[-1:]  # words reversed, eos kept last


@pytest.fixture(scope="module")
def distilled_bin(toy_model, tmp_path_factory):
    """Toy dictionaries, TRAIN sources copied, TRAIN targets reversed."""
    directory = tmp_path_factory.mktemp("distilled")
    for name in ("dict.en.txt", "dict.fr.txt", f"{TRAIN}.en-fr.en.bin", f"{TRAIN}.en-fr.en.idx"):
        shutil.copyfile(toy_model.data_bin / name, directory / name)
    prefix = str(directory / f"{TRAIN}.en-fr.fr")
    vocab_size = len(Dictionary.load(str(directory / "dict.fr.txt")))
    builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(prefix), "mmap", vocab_size=vocab_size)
    for tokens in read_tokens(toy_model.data_bin, TRAIN, "fr"):
        builder.add_item(torch.tensor(reversed_target(tokens), dtype=torch.int32))
    builder.finalize(indexed_dataset.index_file_path(prefix))
    return directory


def task_config(toy_model, **options):
    # the fields fairseq fills from its dataset options when the task is built from the command line
    dataset_options = dict(train_subset=TRAIN, dataset_impl=None, required_seq_len_multiple=1)
    return TranslationDistillConfig(data=str(toy_model.data_bin), **dataset_options, **options)


def load(toy_model, split, mix, distilled_data):
    cfg = task_config(toy_model, distilled_data=str(distilled_data), distill_mix=mix)
    task = TranslationDistillTask.setup_task(cfg)
    task.load_dataset(split)
    dataset = task.dataset(split)
    return [(dataset[i]["source"].tolist(), dataset[i]["target"].tolist()) for i in range(len(dataset))]


def original_pairs(toy_model, split):
    return list(zip(read_tokens(toy_model.data_bin, split, "en"), read_tokens(toy_model.data_bin, split, "fr")))


def test_distilled_mix_trains_on_the_distilled_targets(toy_model, distilled_bin):
    originals = original_pairs(toy_model, TRAIN)
    expected = [(source, reversed_target(target)) for source, target in originals]
    assert load(toy_model, TRAIN, "distilled", distilled_bin) == expected
    # other splits keep their references
    assert load(toy_model, OTHER, "distilled", distilled_bin) == original_pairs(toy_model, OTHER)


def test_both_mix_holds_every_source_with_each_target(toy_model, distilled_bin):
    originals = original_pairs(toy_model, TRAIN)
    distilled = [(source, reversed_target(target)) for source, target in originals]
    assert load(toy_model, TRAIN, "both", distilled_bin) == originals + distilled


def test_original_mix_ignores_the_distilled_data(toy_model, tmp_path):
    assert load(toy_model, TRAIN, "original", tmp_path / "absent") == original_pairs(toy_model, TRAIN)


def test_distilled_data_with_other_dictionaries_is_refused(toy_model, distilled_bin, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(distilled_bin, other)
    lines = (other / "dict.fr.txt").read_text().splitlines(keepends=True)
    (other / "dict.fr.txt").write_text("".join(lines[:3] + [lines[4], lines[3]] + lines[5:]))
    first, second = lines[3].split()[0], lines[4].split()[0]
    with pytest.raises(ValueError, match=f"is {first!r} in the first and {second!r} in the second"):
        load(toy_model, TRAIN, "distilled", other)


def test_distilled_mix_needs_the_distilled_data(toy_model):
    task = TranslationDistillTask.setup_task(task_config(toy_model, distill_mix="distilled"))
    with pytest.raises(ValueError, match="needs --distilled-data"):
        task.load_dataset(TRAIN)
