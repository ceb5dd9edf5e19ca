"""Fixtures of the cluster projection tests: the toy model loaded in this
process, and cluster files made for it; the multilingual toy model (en and de
into fr, one shared transformer) and its directions' tasks."""

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fairseq_fastgen  # noqa: F401  (plugin: checkpoint allow-list, --decoder)
from fairseq import checkpoint_utils
from fairseq_fastgen.cluster.clusterfile import ClusterFile, ModelFingerprint
from fairseq_fastgen.cluster.multilingual import direction_task, model_directions
from fastgen_demo import multi_source, synthetic, toy_multilingual
from fastgen_demo import toy as toy_pipeline
from tests.models.khead_toy import khead_k4  # noqa: F401  (fixture)


def load_model_and_task(checkpoint, data_bin):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data_bin)}
    )
    task.load_dataset("test")
    return SimpleNamespace(model=models[0].eval(), task=task)


@pytest.fixture(scope="session")
def toy(toy_model):
    """The toy model and its task (test split loaded); tests must not modify the model."""
    return load_model_and_task(toy_model.checkpoint, toy_model.data_bin)


@pytest.fixture(scope="session")
def khead(khead_k4):
    """The toy 4-head model (for --decoder blockwise) and its task."""
    return load_model_and_task(khead_k4.checkpoint, khead_k4.data_bin)


def full_coverage_file(model, clusters=4, seed=0, **metadata) -> ClusterFile:
    """Random centroids, every active set the whole vocabulary; ``metadata``: scope and languages."""
    fingerprint = ModelFingerprint.of_decoder(model.decoder)
    centroids = torch.randn(clusters, fingerprint.hidden_size, generator=torch.Generator().manual_seed(seed))
    every_token = list(range(fingerprint.vocab_size))
    return ClusterFile.build(centroids, [every_token] * clusters, fingerprint, top_k=1, states=0, **metadata)


@pytest.fixture(scope="session")
def full_coverage_path(toy, tmp_path_factory):
    path = tmp_path_factory.mktemp("clusters") / "full.pt"
    full_coverage_file(toy.model).save(path)
    return path


@pytest.fixture(scope="session")
def khead_full_coverage_path(khead, tmp_path_factory):
    path = tmp_path_factory.mktemp("clusters") / "khead_full.pt"
    full_coverage_file(khead.model).save(path)
    return path


CLI_SENTENCES = 24


@pytest.fixture(scope="session")
def small_test_bin(toy_model):
    """A data-bin whose test split holds the first CLI_SENTENCES toy test sentences (toy dictionaries)."""
    def build(out_dir):
        for lang in (toy_pipeline.SRC, toy_pipeline.TGT):
            lines = (toy_model.raw / f"test.{lang}").read_text().splitlines()[:CLI_SENTENCES]
            (out_dir / f"test.{lang}").write_text("\n".join(lines) + "\n")
        toy_pipeline.run(toy_pipeline.fairseq_command("preprocess") + [
            "--source-lang", toy_pipeline.SRC, "--target-lang", toy_pipeline.TGT, "--testpref", str(out_dir / "test"),
            "--srcdict", str(toy_model.data_bin / f"dict.{toy_pipeline.SRC}.txt"),
            "--tgtdict", str(toy_model.data_bin / f"dict.{toy_pipeline.TGT}.txt"),
            "--destdir", str(out_dir / "bin"), "--workers", "1",
        ])

    key = [toy_model.root.name, CLI_SENTENCES]
    return toy_pipeline.cached_build("toy-test-subset", key, build) / "bin"


@pytest.fixture(scope="session")
def train_clusters_command():
    """The installed console script, or the module when the package is not installed."""
    script = Path(sys.executable).parent / "fastgen-train-clusters"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fairseq_fastgen.cluster.train"]


@pytest.fixture(scope="session")
def trained_cluster_run(toy_model, train_clusters_command, tmp_path_factory):
    """fastgen-train-clusters on the toy model: its settings, the file and the command output."""
    run = SimpleNamespace(clusters=16, top_k=3, states=3000, path=tmp_path_factory.mktemp("trained") / "toy.clusters.pt")
    run.output = toy_pipeline.run(train_clusters_command + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--split", "train",
        "--num-clusters", str(run.clusters), "--top-k", str(run.top_k),
        "--max-states", str(run.states), "--output", str(run.path), "--cpu",
    ])
    return run


@pytest.fixture(scope="session")
def trained_cluster_path(trained_cluster_run):
    return trained_cluster_run.path


# ---- the multilingual toy model ------------------------------------------------------------------
MULTILINGUAL_SPEC = toy_pipeline.ToyModelSpec(max_update=200, max_tokens=2000, warmup=50, validate_interval=1000,
                                              extra_args=["--share-all-embeddings"])
MULTILINGUAL_SIZES = {"n_train": 3000, "n_valid": 40, "n_test": 40}  # sentences per direction


@pytest.fixture(scope="session")
def multilingual_toy_model():
    """en-fr and de-fr in one transformer (translation_multi_simple_epoch), trained once by the real
    fairseq-train (about a minute on 2 cores) and cached like the toy transformer."""
    steps = (toy_pipeline.train, toy_pipeline.ToyModelSpec.train_args)
    key = [toy_pipeline.source_fingerprint(synthetic, multi_source, toy_multilingual),
           *(inspect.getsource(f) for f in steps), repr(MULTILINGUAL_SPEC), repr(MULTILINGUAL_SIZES)]
    root = toy_pipeline.cached_build("toy-multilingual", key, lambda d: toy_multilingual.build_multilingual_toy_model(
        d, MULTILINGUAL_SPEC, **MULTILINGUAL_SIZES))
    pairs = toy_multilingual.multilingual_pairs()
    return SimpleNamespace(root=root, raw=root / "raw", data_bin=root / "bin",
                           checkpoint=root / "ckpt" / "checkpoint_last.pt", pairs=pairs,
                           task_args=toy_multilingual.multilingual_task_args(pairs))


@pytest.fixture(scope="session")
def multilingual(multilingual_toy_model):
    """The multilingual model, its task as trained (no direction) and, per direction ("en-fr", ...),
    the task set up as fairseq-generate sets it up for that direction (test split loaded)."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(multilingual_toy_model.checkpoint)], arg_overrides={"data": str(multilingual_toy_model.data_bin)})
    directions = {}
    for source_lang, target_lang in model_directions(task):
        directions[f"{source_lang}-{target_lang}"] = direction_task(task, source_lang, target_lang)
        directions[f"{source_lang}-{target_lang}"].load_dataset("test")
    return SimpleNamespace(model=models[0].eval(), task=task, directions=directions)
