"""Fairseq-generate with --postprocess-workers prints exactly what stock fairseq prints.

Stock here is fairseq-generate without the plugin (with --required-batch-size-multiple 1,
so that stock keeps every sentence).  Log lines are left out of the comparison;
every other line (S/T/H/D/P/A and the final BLEU line) must be byte-identical.
"""

import inspect
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastgen_demo import synthetic, toy
from tests.processes import children, finish, start_reading_until

pytestmark = pytest.mark.xdist_group("test_async_generate")

SPM_TEST_SENTENCES = 400
SPM_VOCABULARY = 1000
SPM_MODEL_SPEC = toy.ToyModelSpec(max_update=200, max_positions=256, validate_interval=1000)


def build_sentencepiece_toy(out_dir):
    """The toy corpus as sentencepiece pieces (one joint model for both languages),
    binarized, and a tiny transformer trained on it."""
    import sentencepiece

    out_dir = Path(out_dir)
    raw, pieces = out_dir / "raw", out_dir / "spm"
    toy.make_corpus(raw, n_train=2000, n_valid=50, n_test=SPM_TEST_SENTENCES)
    pieces.mkdir()
    sentencepiece.SentencePieceTrainer.train(
        input=f"{raw}/train.{toy.SRC},{raw}/train.{toy.TGT}", model_prefix=str(out_dir / "spm"),
        vocab_size=SPM_VOCABULARY, model_type="unigram", character_coverage=1.0, num_threads=1,
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(out_dir / "spm.model"))
    for path in raw.iterdir():
        lines = path.read_text(encoding="utf-8").splitlines()
        encoded = (" ".join(processor.encode(line, out_type=str)) for line in lines)
        (pieces / path.name).write_text("".join(line + "\n" for line in encoded), encoding="utf-8")
    toy.binarize(pieces, out_dir / "bin")
    (out_dir / "ckpt").mkdir()
    toy.train(out_dir / "bin", out_dir / "ckpt", SPM_MODEL_SPEC)


@pytest.fixture(scope="session")
def sentencepiece_toy():
    import sentencepiece

    key = [toy.source_fingerprint(toy, synthetic), repr(SPM_MODEL_SPEC), SPM_TEST_SENTENCES, SPM_VOCABULARY,
           sentencepiece.__version__, inspect.getsource(build_sentencepiece_toy)]
    root = toy.cached_build("toy-sentencepiece", key, build_sentencepiece_toy)
    return root / "bin", root / "ckpt" / "checkpoint_last.pt", root / "spm.model"


def generate(data_bin, checkpoint, *args, plugin=True, program=None):
    """Run fairseq-generate (or ``program``, a python source taking its arguments); returns the completed process."""
    if program:
        command = [sys.executable, "-c", program]
    else:
        command = toy.fairseq_command("generate") if plugin else toy.stock_fairseq_command("generate")
    command += [str(data_bin), "--path", str(checkpoint), "--cpu", "--required-batch-size-multiple", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # both sides alike; the test machines' cores are shared
    if plugin:
        command += ["--user-dir", toy.PLUGIN_DIR]
    return subprocess.run(command + list(args), capture_output=True, text=True, env=env)


def printed_lines(completed):
    """The output lines that are not log records."""
    assert completed.returncode == 0, completed.stderr[-3000:]
    return [line for line in completed.stdout.splitlines() if " | INFO | " not in line and " | WARNING | " not in line]


def assert_identical_to_stock(data_bin, checkpoint, options, sentences):
    stock = printed_lines(generate(data_bin, checkpoint, *options, plugin=False))
    asynchronous = printed_lines(generate(data_bin, checkpoint, *options, "--postprocess-workers", "4"))
    assert sum(line.startswith("S-") for line in stock) == sentences
    assert stock[-1].startswith("Generate test with beam=")
    assert asynchronous == stock


@pytest.mark.parametrize("post_processing", ["post-process", "bpe"])
def test_sentencepiece_output_is_stock_output(sentencepiece_toy, post_processing):
    data_bin, checkpoint, sentencepiece_model = sentencepiece_toy
    options = ["--beam", "4", "--batch-size", "16", "--max-len-a", "1.2", "--max-len-b", "10"]
    if post_processing == "post-process":  # pieces joined by fairseq's dictionary; BLEU on re-encoded tokens
        options += ["--post-process", "sentencepiece", "--nbest", "2"]
    else:  # pieces joined by the --bpe decoder; sacrebleu on the strings
        options += ["--bpe", "sentencepiece", "--sentencepiece-model", str(sentencepiece_model), "--scoring", "sacrebleu"]
    assert_identical_to_stock(data_bin, checkpoint, options, SPM_TEST_SENTENCES)


def test_remove_bpe_and_alignment_output_is_stock_output(toy_model):
    options = ["--beam", "4", "--batch-size", "8", "--remove-bpe", "--print-alignment", "hard"]
    assert_identical_to_stock(toy_model.data_bin, toy_model.checkpoint, options, 200)


FAILING_WORKER = """
import sys
import fairseq_fastgen
from fairseq_fastgen.cli import async_generate

calls = []
decode = async_generate.BatchFormatter.decode

def decode_failing_on_the_100th_call(self, text):
    calls.append(text)
    if len(calls) == 100:
        raise RuntimeError("detokenizer exploded on purpose")
    return decode(self, text)

async_generate.BatchFormatter.decode = decode_failing_on_the_100th_call
from fairseq_cli.generate import cli_main
sys.argv[0] = "fairseq-generate"
cli_main()
"""


def test_worker_error_stops_the_run_with_that_error(toy_model):
    completed = generate(toy_model.data_bin, toy_model.checkpoint, "--beam", "2", "--batch-size", "8",
                         "--postprocess-workers", "4", program=FAILING_WORKER)
    assert completed.returncode != 0
    assert "RuntimeError: detokenizer exploded on purpose" in completed.stderr
    assert "decode_failing_on_the_100th_call" in completed.stderr  # the worker's traceback
    assert "Generate test with beam=" not in completed.stdout
    # what was printed is whole batches of 8 sentences (S/T/H/D/P lines), before the failing one
    sources = [line for line in completed.stdout.splitlines() if line.startswith("S-")]
    hypotheses = [line for line in completed.stdout.splitlines() if line.startswith("P-")]
    assert len(sources) == len(hypotheses) and len(sources) % 8 == 0 and len(sources) < 200


def start_long_run(toy_model, stderr_file):
    """fairseq-generate with 2 post-processing workers over the 4000 training sentences, one per batch: still
    running long after its first output.  Returns the process, once it has printed its first hypothesis, and
    the lines read so far and a reader of the rest."""
    command = toy.fairseq_command("generate") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--user-dir", toy.PLUGIN_DIR,
        "--gen-subset", "train", "--beam", "1", "--batch-size", "1", "--postprocess-workers", "2",
        "--num-workers", "0",  # no data-loader process: the only children are the two workers
    ]
    return start_reading_until(command, "^H-", stderr_file, env=dict(os.environ, OMP_NUM_THREADS="1"))


SENTENCE_LINE = re.compile(r"(?P<kind>[A-Z])-(?P<id>\d+)\t")


def assert_whole_sentences(output, written, kinds="STHDP"):
    """Every sentence in the output has its lines of ``kinds`` (fairseq-generate: S, T, H, D and P), each once,
    and the output ends with a newline; ``written`` sentences in all."""
    assert output.endswith("\n")
    found = {}
    for line in output.splitlines():
        match = SENTENCE_LINE.match(line)
        if match:
            found.setdefault(int(match["id"]), []).append(match["kind"])
    assert all(sorted(sentence) == sorted(kinds) for sentence in found.values()), found
    assert len(found) == written


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_every_worker_and_reports_what_was_written(toy_model, tmp_path, signum):
    """SIGTERM left both workers running as orphans, blocked on the job queue."""
    with open(tmp_path / "stderr", "w") as stderr_file:
        process, lines, reader = start_long_run(toy_model, stderr_file)
        workers = children(process.pid)
        try:
            process.send_signal(signum)
        finally:
            rest, survivors = finish(process, workers, reader)
    stderr = (tmp_path / "stderr").read_text()
    assert len(workers) == 2 and survivors == []
    output = "".join(lines) + rest
    assert process.returncode == 128 + signum, stderr[-2000:]
    report = re.search(rf"fairseq-generate: stopped by {signum.name}; (\d+) of 4000 sentences were written, each "
                       rf"with all its lines; the other (\d+) were not", stderr)
    assert report, stderr[-2000:]
    assert 0 < int(report[1]) < 4000 and int(report[1]) + int(report[2]) == 4000
    assert_whole_sentences(output, int(report[1]))
    assert "Generate train with beam=" not in output


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_is_reported_and_fails_the_run(toy_model, tmp_path, victim):
    """Killing the worker that waited for the queue's lock behind the other one ended the run
    with status 0 and every line, the death unreported."""
    with open(tmp_path / "stderr", "w") as stderr_file:
        process, lines, reader = start_long_run(toy_model, stderr_file)
        workers = children(process.pid)
        try:
            os.kill(workers[victim], signal.SIGKILL)
        finally:
            rest, survivors = finish(process, workers, reader)
    stderr = (tmp_path / "stderr").read_text()
    assert len(workers) == 2 and survivors == []
    output = "".join(lines) + rest
    assert process.returncode == 1, stderr[-2000:]
    report = re.search(rf"fairseq-generate: post-processing worker postprocess-\d \(pid {workers[victim]}\) "
                       rf"died \(killed by SIGKILL\); (\d+) of 4000 sentences were written", stderr)
    assert report, stderr[-2000:]
    assert_whole_sentences(output, int(report[1]))


class RecordingScorer:
    def __init__(self):
        self.pairs = []

    def add(self, ref, pred):
        self.pairs.append((ref.tolist(), pred.tolist()))


def test_scorer_ids_are_those_of_stock_whatever_order_batches_finish():
    """fairseq's BLEU re-encodes the detokenized strings, adding unseen words to the target dictionary in
    sentence order, and hashes n-grams of those ids: the ids fed to the scorer must be stock's, so the
    main process encodes them in decoding order even when workers finish batches out of order."""
    import io

    from fairseq.data import Dictionary

    from fairseq_fastgen.cli.async_generate import BatchOutput, OrderedWriter, ScoreInput

    dictionary = Dictionary()
    for word in ["a", "dog", "runs"]:
        dictionary.add_symbol(word)
    sentences = [("a dog runs", "a cat runs"), ("the cat sleeps", "a dog sleeps"), ("the cat", "a bird")]
    expected_dictionary = Dictionary()
    for word in ["a", "dog", "runs"]:
        expected_dictionary.add_symbol(word)
    expected = [(expected_dictionary.encode_line(t, add_if_not_exist=True).tolist(),
                 expected_dictionary.encode_line(h, add_if_not_exist=True).tolist()) for t, h in sentences]

    scorer, output = RecordingScorer(), io.StringIO()
    writer = OrderedWriter(output, scorer, dictionary)
    batches = [BatchOutput(index, f"line {index}\n", [ScoreInput(t, h, None, None)], True)
               for index, (t, h) in enumerate(sentences)]
    writer.write_ready([batches[2]])  # the last batch finishes first
    writer.write_ready([batches[1], batches[0]])
    assert output.getvalue() == "line 0\nline 1\nline 2\n"
    assert scorer.pairs == expected
    assert dictionary.symbols == expected_dictionary.symbols
