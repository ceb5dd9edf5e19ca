"""What fastgen-distill refuses or reports.  In-process, on small inputs:
each case fails before decoding or decodes a handful of sentences."""

import logging
import shutil
import time

import pytest
import torch

from fairseq.data import Dictionary, indexed_dataset
from fairseq_fastgen import distill
from fairseq_fastgen.distill import DistillError
from fairseq_fastgen.option_checks import UsageError
from tests.distill.distill_runs import REFERENCE_ARGS, SPLIT, read_tokens

pytestmark = pytest.mark.xdist_group("toy_distill")  # shares the reference run of test_distill_cli.py

QUICK = ["--split", SPLIT, "--cpu", "--no-progress-bar", "--decoder", "greedy", "--beam", "1"]
ALONE = ["--batch-size", "1"]  # each sentence decoded alone: batch composition cannot matter


def distill_args(data_bin, checkpoint, out, *extra):
    return [str(data_bin), "--path", str(checkpoint), "--output-dir", str(out), *extra]


def data_bin_with_split(toy_model, directory, sources, targets, split=SPLIT):
    """A data-bin with the toy dictionaries and one split holding the given token lists."""
    directory.mkdir()
    for lang, sentences in (("en", sources), ("fr", targets)):
        shutil.copyfile(toy_model.data_bin / f"dict.{lang}.txt", directory / f"dict.{lang}.txt")
        prefix = str(directory / f"{split}.en-fr.{lang}")
        vocab = Dictionary.load(str(directory / f"dict.{lang}.txt"))
        builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(prefix), "mmap", vocab_size=len(vocab))
        for tokens in sentences:
            builder.add_item(torch.tensor(tokens, dtype=torch.int32))
        builder.finalize(indexed_dataset.index_file_path(prefix))
    return directory


def dictionary_dir(toy_model, directory, edit_target_lines):
    """The toy dictionaries, the target one's lines passed through ``edit_target_lines``."""
    directory.mkdir()
    shutil.copyfile(toy_model.data_bin / "dict.en.txt", directory / "dict.en.txt")
    lines = (toy_model.data_bin / "dict.fr.txt").read_text().splitlines(keepends=True)
    (directory / "dict.fr.txt").write_text("".join(edit_target_lines(lines)))
    return directory


def toy_teacher_recording(toy_model, data_dir, path):
    """A copy of the toy checkpoint that records ``data_dir`` as the data it was trained on."""
    state = torch.load(toy_model.checkpoint, weights_only=False)
    state["cfg"]["task"]["data"] = str(data_dir)
    torch.save(state, path)
    return path


def test_teacher_trained_with_other_dictionaries_is_refused_naming_the_symbol(toy_model, tmp_path):
    def swap_11th_and_12th(lines):
        return lines[:10] + [lines[11], lines[10]] + lines[12:]

    teacher_bin = dictionary_dir(toy_model, tmp_path / "teacher-bin", swap_11th_and_12th)
    # the same weights, recorded as trained on teacher-bin (same sizes: loading alone would not notice)
    teacher = toy_teacher_recording(toy_model, teacher_bin, tmp_path / "teacher.pt")

    with pytest.raises(DistillError) as refusal:
        distill.main(distill_args(toy_model.data_bin, teacher, tmp_path / "out", *QUICK))
    lines = (toy_model.data_bin / "dict.fr.txt").read_text().splitlines()
    moved_up, moved_down = lines[11].split()[0], lines[10].split()[0]
    message = str(refusal.value)
    assert "dict.fr.txt" in message
    assert f"is {moved_up!r} in the first and {moved_down!r} in the second" in message
    assert not (tmp_path / "out" / f"{SPLIT}.en-fr.fr.bin").exists()


def test_teacher_that_does_not_fit_the_dictionaries_is_refused(toy_model, tmp_path):
    """Where the teacher's own dictionaries are gone, a size difference still stops the run."""
    data_bin = dictionary_dir(toy_model, tmp_path / "bin", lambda lines: lines + ["zzextra 1\n"])
    for lang in ("en", "fr"):
        for extension in ("bin", "idx"):
            name = f"{SPLIT}.en-fr.{lang}.{extension}"
            shutil.copyfile(toy_model.data_bin / name, data_bin / name)
    teacher = toy_teacher_recording(toy_model, tmp_path / "moved-away", tmp_path / "teacher.pt")
    sizes = [len(Dictionary.load(str(data_bin / f"dict.{lang}.txt"))) for lang in ("en", "fr")]
    with pytest.raises(DistillError, match=rf"does not fit DATA's dictionaries \({sizes[0]} / {sizes[1]} symbols\)"):
        distill.main(distill_args(data_bin, teacher, tmp_path / "out", *QUICK))


def test_teacher_data_option_is_checked(toy_model, tmp_path):
    teacher_bin = dictionary_dir(toy_model, tmp_path / "teacher-bin", lambda lines: lines + ["zzextra 1\n"])
    with pytest.raises(DistillError, match="the first has 1 more symbols, starting with 'zzextra'"):
        distill.main(distill_args(toy_model.data_bin, toy_model.checkpoint, tmp_path / "out", *QUICK,
                                  "--teacher-data", str(teacher_bin)))


def test_empty_split_is_refused(toy_model, tmp_path):
    data_bin = data_bin_with_split(toy_model, tmp_path / "bin", [], [])
    with pytest.raises(DistillError, match=f"split '{SPLIT}' of .* is empty"):
        distill.main(distill_args(data_bin, toy_model.checkpoint, tmp_path / "out", *QUICK))


@pytest.fixture
def one_thread():
    """In-process decoding with one thread, as a worker on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_long_sources_are_truncated_counted_and_kept(toy_model, tmp_path, caplog, one_thread):
    sources = read_tokens(toy_model.data_bin, SPLIT, "en")[:5]
    targets = read_tokens(toy_model.data_bin, SPLIT, "fr")[:5]
    eos = sources[0][-1]
    max_positions = 64  # the toy model's
    long_source = (sources[0][:-1] * 20)[:100] + [eos]  # (101,)
    cut_source = long_source[: max_positions - 1] + [eos]  # what the teacher can read

    targets = targets[:2] + targets[:4]  # any six
    with_long = data_bin_with_split(toy_model, tmp_path / "long", sources[:2] + [long_source] + sources[2:], targets)
    with_cut = data_bin_with_split(toy_model, tmp_path / "cut", sources[:2] + [cut_source] + sources[2:], targets)
    with caplog.at_level(logging.WARNING, logger="fairseq_fastgen.distill"):
        summary = distill.main(distill_args(with_long, toy_model.checkpoint, tmp_path / "out-long", *QUICK, *ALONE))
    reference = distill.main(distill_args(with_cut, toy_model.checkpoint, tmp_path / "out-cut", *QUICK, *ALONE))

    assert (summary["sentences"], summary["truncated_sources"], summary["truncated_sentence_ids"]) == (6, 1, [2])
    assert reference["truncated_sources"] == 0
    assert "1 sources were longer than the teacher's maximum positions and were truncated" in caplog.text
    # the source side keeps the whole sentence; its target is the teacher's output for the cut one
    assert read_tokens(tmp_path / "out-long", SPLIT, "en")[2] == long_source
    assert read_tokens(tmp_path / "out-long", SPLIT, "fr") == read_tokens(tmp_path / "out-cut", SPLIT, "fr")


def copy_of_reference_shards(reference_run, out):
    shutil.copytree(reference_run.out / "distill-shards", out / "distill-shards")
    return out / "distill-shards" / SPLIT


@pytest.mark.parametrize("damage", ["missing shard", "wrong sentences"])
def test_incomplete_shards_are_not_merged(reference_run, toy_model, tmp_path, damage):
    out = tmp_path / "out"
    shard_dir = copy_of_reference_shards(reference_run, out)
    third = shard_dir / "shard-00002-of-00004.npz"
    if damage == "missing shard":
        third.unlink()
        expected = r"refusing to write an incomplete data-bin: shards \[2\] of 4 are missing"
    else:
        shutil.copyfile(shard_dir / "shard-00001-of-00004.npz", third)
        expected = "does not hold sentences 100..149 exactly once"
    job = distill.open_job(distill_args(toy_model.data_bin, toy_model.checkpoint, out, *REFERENCE_ARGS))
    with pytest.raises(DistillError, match=expected):
        distill.merge_shards(job, time.time(), workers=1)
    assert list(out.glob("*.bin")) == []


def test_resuming_with_other_settings_is_refused(reference_run, toy_model, tmp_path):
    out = tmp_path / "out"
    copy_of_reference_shards(reference_run, out)
    beam_at = REFERENCE_ARGS.index("--beam") + 1
    other_beam = REFERENCE_ARGS[:beam_at] + ["3"] + REFERENCE_ARGS[beam_at + 1:]
    with pytest.raises(DistillError, match=r"other settings \(changed: generation.beam\)"):
        distill.main(distill_args(toy_model.data_bin, toy_model.checkpoint, out, *other_beam))


@pytest.mark.parametrize("extra, message", [
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--num-shards", "-1"], "--num-shards must be an integer >= 0, got -1"),
    (["--decoder", "var-batch", "--var-beam-delta", "nan"], "--var-beam-delta must be a number >= 0 or inf, got nan"),
])
def test_numbers_out_of_range_are_refused_when_parsed(tmp_path, extra, message):
    """Refused before anything is read (DATA and the teacher need not exist), as a misuse (exit
    status 2 through the command line: test_distill_misuse.py)."""
    argv = distill_args(tmp_path / "data", tmp_path / "teacher.pt", tmp_path / "out", *extra)
    with pytest.raises(UsageError) as refusal:
        distill.parse(argv)
    assert str(refusal.value) == message
    (tmp_path / "teacher.pt").touch()  # the one file parse opens: --path must name a readable file
    args, _ = distill.parse(distill_args(tmp_path / "data", tmp_path / "teacher.pt", tmp_path / "out",
                                         "--workers", "2", "--num-shards", "0"))
    assert (args.workers, args.num_shards) == (2, 0)
