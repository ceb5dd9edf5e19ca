"""Fastgen-distill through its real command line, on the toy model."""

import json
import sys

import pytest
import sacrebleu
import torch

from fairseq.criterions import CRITERION_REGISTRY
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq_fastgen.distill import INTERRUPTED_EXIT_CODE, STOP_AFTER_SHARDS_ENV
from fastgen_demo import toy
from tests.distill.distill_runs import ONE_THREAD, REFERENCE_ARGS, SPLIT, read_tokens, run, run_distill, same_bytes

pytestmark = pytest.mark.xdist_group("toy_distill")

TARGET_FILES = [f"{SPLIT}.en-fr.fr.bin", f"{SPLIT}.en-fr.fr.idx"]


def generate_lines(output, kind):
    """{sentence id: text} of fairseq-generate's lines of one kind (H: hypothesis, T: target)."""
    lines = {}
    for line in output.splitlines():
        if line.startswith(f"{kind}-"):
            fields = line.split("\t")
            lines[int(fields[0][2:])] = fields[-1]
    return lines


def test_targets_are_the_teachers_beam_outputs(toy_model, plugin_dir, tmp_path):
    settings = ["--beam", "3", "--batch-size", "16"]
    out = tmp_path / "distilled"
    distilled = run_distill(toy_model, out, "--split", "test", *settings, "--cpu", "--no-progress-bar", env=ONE_THREAD)
    assert distilled.returncode == 0, distilled.stdout[-3000:] + distilled.stderr[-3000:]
    generated = run(toy.fairseq_command("generate") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
        "--gen-subset", "test", *settings,
    ], env=ONE_THREAD)
    assert generated.returncode == 0, generated.stderr[-3000:]

    hypotheses = generate_lines(generated.stdout, "H")
    tgt_dict = Dictionary.load(str(toy_model.data_bin / "dict.fr.txt"))
    targets = read_tokens(out, "test", "fr")
    assert len(targets) == len(hypotheses) == 200
    assert all(t[-1] == tgt_dict.eos() for t in targets)
    differing = [i for i, t in enumerate(targets) if tgt_dict.string(torch.tensor(t)) != hypotheses[i]]
    assert differing == [], f"distilled targets differ from fairseq-generate's for sentences {differing[:10]}"

    # the source side and the dictionaries are DATA's; the other splits are copied
    for name in ["test.en-fr.en.bin", "test.en-fr.en.idx", "dict.en.txt", "dict.fr.txt", "valid.en-fr.fr.bin"]:
        assert same_bytes(out / name, toy_model.data_bin / name), name
    # the reported BLEU is sacreBLEU of the same hypotheses against fairseq-generate's reference lines
    summary = json.loads((out / "distill.test.json").read_text())
    references = generate_lines(generated.stdout, "T")
    expected = sacrebleu.corpus_bleu([hypotheses[i] for i in range(200)], [[references[i] for i in range(200)]])
    assert summary["teacher_bleu"] == pytest.approx(expected.score)
    assert (summary["sentences"], summary["truncated_sources"]) == (200, 0)


def test_two_torchrun_ranks_write_the_same_data_bin_as_one_process(reference_run, toy_model, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "fairseq_fastgen.distill"]
    out = tmp_path / "torchrun"
    completed = run_distill(toy_model, out, *REFERENCE_ARGS, env=ONE_THREAD, launcher=torchrun)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    for name in TARGET_FILES:
        assert same_bytes(out / name, reference_run.out / name), name
    summary = json.loads((out / f"distill.{SPLIT}.json").read_text())
    assert summary["workers"] == 2
    assert "worker 0: decoded" in completed.stdout and "worker 1: decoded" in completed.stdout


def test_interrupted_run_resumes_without_redoing_shards(reference_run, toy_model, tmp_path):
    out = tmp_path / "interrupted"
    shard_dir = out / "distill-shards" / SPLIT
    first = run_distill(toy_model, out, *REFERENCE_ARGS, env={**ONE_THREAD, STOP_AFTER_SHARDS_ENV: "1"})
    assert first.returncode == INTERRUPTED_EXIT_CODE, first.stdout[-3000:] + first.stderr[-3000:]
    assert sorted(p.name for p in shard_dir.glob("shard-*")) == ["shard-00000-of-00004.npz"]
    assert not (out / TARGET_FILES[0]).exists()  # nothing merged
    first_shard_written = (shard_dir / "shard-00000-of-00004.npz").stat().st_mtime_ns
    # what a kill while decoding shard 1 leaves: its claim, and a half-written temporary file
    (shard_dir / "shard-00001-of-00004.claim").touch()
    (shard_dir / ".shard-00001-of-00004.npz.12345.tmp").write_bytes(b"partial")

    second = run_distill(toy_model, out, *REFERENCE_ARGS, "--workers", "2", env=ONE_THREAD)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming: 1 of 4 shards of 'valid' already done, 3 to distill" in second.stdout
    assert (shard_dir / "shard-00000-of-00004.npz").stat().st_mtime_ns == first_shard_written
    assert "shard 1/4 done" not in second.stdout
    assert all(f"shard {i}/4 done" in second.stdout for i in (2, 3, 4))
    for name in TARGET_FILES:
        assert same_bytes(out / name, reference_run.out / name), name
    summary = json.loads((out / f"distill.{SPLIT}.json").read_text())
    assert (summary["sentences"], summary["sentences_this_run"]) == (200, 150)


STUDENTS = [  # architecture, criterion, their options, --distill-mix
    ("transformer", "cross_entropy", [], "distilled"),
    ("transformer", "label_smoothed_cross_entropy", ["--label-smoothing", "0.1"], "both"),
    ("transformer_khead", "random_subloss", ["--label-smoothing", "0.1", "--block-size", "2"], "distilled"),
]


@pytest.mark.parametrize("arch, criterion, options, mix", STUDENTS)
def test_student_trains_on_the_distilled_data_bin(reference_run, toy_model, tmp_path, monkeypatch,
                                                  arch, criterion, options, mix):
    """translation_distill through the real fairseq-train, the distilled valid split as training data."""
    if arch not in ARCH_MODEL_REGISTRY or criterion not in CRITERION_REGISTRY:
        pytest.skip(f"{arch} or {criterion} is not registered")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: one thread is faster on a shared machine
    spec = toy.ToyModelSpec(arch=arch, max_update=3, validate_interval=1000, extra_args=[
        "--task", "translation_distill", "--distilled-data", str(reference_run.out), "--distill-mix", mix,
        "--train-subset", SPLIT, "--valid-subset", "test",
    ])
    checkpoint = toy.train(toy_model.data_bin, tmp_path, spec, criterion_args=["--criterion", criterion, *options])
    log = (tmp_path / "train.log").read_text()
    assert f"loaded 200 examples from: {reference_run.out / f'{SPLIT}.en-fr.fr'}" in log
    if mix == "both":
        assert f"{SPLIT}: 200 original + 200 distilled pairs" in log
    state = torch.load(checkpoint, weights_only=False)
    assert state["optimizer_history"][-1]["num_updates"] == 3
