"""Toy models of the reference presets' architecture (the project's reference models are
transformer-base, fairseq's ``transformer_wmt_en_de``, and -big, ``transformer_vaswani_wmt_en_de_big``, with a
32k vocabulary and ``--share-all-embeddings``; benchmarks/multi30k.py SIZES).

Each keeps its preset's structure (the ``--arch`` itself, 6 encoder and 6 decoder layers, post-norm, ReLU, sinusoidal
positions, its attention heads, FFN 4x the width, all embeddings shared through a joined dictionary) and scales its
widths down to 64 (head dimension 8 for base's 8 heads, 4 for big's 16), trained for two updates by the real
fairseq-train (see ``preset_spec``) on the toy corpus of the ``toy_model`` fixture, binarized again with
``--joined-dictionary``.  Beside each, a frozen-base k = 4 ``transformer_khead`` student of the same preset
(``transformer_khead_<preset>``, ``--khead-identity-first --freeze-base``, as benchmarks/multi30k.py's
``khead_spec``), trained for five updates.

fairseq's two presets differ only in widths (512 / 1024, FFN 2048 / 4096), the head count (8 / 16) and the training
dropout (0.1 / 0.3); both are post-norm with the same layers and activations.  At a width of 64 the widths no longer
differ, so the two toys differ in their head count (and the --arch name); both are kept because the head count is a
shape every engine reshapes by (keys and values as (rows, heads, positions, head dim)): an engine that split
attention into 8 heads whatever the model's count passes every test of the base toy and fails the big one's.  Built
once and cached like the toy transformer (``toy.cached_build``): the joined data-bin, then each preset's model and
student (about 2 minutes in all on a loaded 2-core machine).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from fairseq_fastgen.criterions import random_subloss
from fairseq_fastgen.models import transformer_khead
from fastgen_demo import synthetic, toy

# preset -> its attention heads (fairseq's values; every other dimension is scaled down alike)
PRESETS = {"transformer_wmt_en_de": 8, "transformer_vaswani_wmt_en_de_big": 16}
DIM = 64
BLOCK_SIZE = 4


@dataclass
class PresetToy:
    arch: str
    heads: int
    data_bin: Path  # the toy corpus binarized with a joined dictionary
    checkpoint: Path  # the preset-shaped transformer
    student: Path  # its k = 4 identity-first frozen-base student


def preset_spec(arch, heads, **overrides) -> toy.ToyModelSpec:
    """Two updates: a few more and the preset's 6 post-norm layers collapse onto the corpus's most frequent token
    (after 10, every sentence decodes to ". . ."), and leaving that takes minutes of training; after two the
    model is its initialization nudged, whose greedy output differs from sentence to sentence (mostly one token
    repeated) and whose positional scores the tests compare as well as its tokens."""
    return toy.ToyModelSpec(**{
        "arch": arch, "layers": 6, "dim": DIM, "ffn": 4 * DIM, "heads": heads, "max_update": 2, "warmup": 40,
        "validate_interval": 1000, "extra_args": ["--share-all-embeddings"], **overrides,
    })


def student_spec(arch, heads, base_checkpoint) -> toy.ToyModelSpec:
    khead_arch = "transformer_khead_" + arch[len("transformer_"):]  # the preset's k-head form
    spec = preset_spec(arch, heads)
    # a learning rate that keeps the heads near their start (the base's own prediction, repeated by the two-update
    # base's output), so that blocks of several tokens are accepted and others rejected
    return preset_spec(khead_arch, heads, max_update=5, warmup=4, lr=0.0003, extra_args=spec.extra_args + [
        "--block-size", str(BLOCK_SIZE), "--khead-identity-first", "--freeze-base",
        "--base-checkpoint", str(base_checkpoint)])


def joined_data_bin(toy_model) -> Path:
    """The toy corpus binarized with one dictionary for both languages (--share-all-embeddings needs it)."""
    key = [toy.source_fingerprint(toy, synthetic), toy_model.root.name]
    return toy.cached_build("toy-joined-bin", key, lambda out: toy.binarize(toy_model.raw, out / "bin",
                                                                           joined_dictionary=True)) / "bin"


def build_preset(toy_model, arch) -> PresetToy:
    heads = PRESETS[arch]
    data_bin = joined_data_bin(toy_model)
    spec = preset_spec(arch, heads)
    key = [toy.source_fingerprint(toy, synthetic), repr(spec), data_bin.parent.name]
    base = toy.cached_build(f"toy-preset-{arch}", key, lambda out: toy.train(data_bin, out, spec))
    checkpoint = base / "checkpoint_last.pt"

    student = student_spec(arch, heads, checkpoint)
    key = [toy.source_fingerprint(toy, synthetic, transformer_khead, random_subloss), repr(student), base.name]
    student_dir = toy.cached_build(f"toy-preset-{arch}-k{BLOCK_SIZE}", key, lambda out: toy.train(
        data_bin, out, student, criterion_args=["--criterion", "random_subloss", "--label-smoothing", "0.1"]))
    return PresetToy(arch, heads, data_bin, checkpoint, student_dir / "checkpoint_last.pt")


@pytest.fixture(scope="session", params=list(PRESETS), ids=["base", "big"])
def preset_toy(request, toy_model) -> PresetToy:
    return build_preset(toy_model, request.param)
