"""SIGTERM and SIGINT to fairseq-generate (without --postprocess-workers) and fairseq-interactive end
every child process they started, write whole sentences only, say on stderr how many were written, and exit with
status 128 + the signal.

Stock, SIGTERM ended either command at once (status -15): lines still buffered were lost, the last one written
could stop in the middle, and the data-loader worker ran on as an orphan; SIGINT ended it with a traceback."""

import array
import fcntl
import os
import re
import signal
import subprocess
import termios
import time

import pytest

from fastgen_demo import toy
from tests.cli.test_async_generate import assert_whole_sentences
from tests.processes import children, finish, start_reading_until, wait_for_children

pytestmark = pytest.mark.xdist_group("test_stop_signals")

TRAIN_SENTENCES = 4000  # the toy's training split: far more than a test lets run


def stop_after_first_answer(command, tmp_path, signum, stdin=None, has_children=True):
    """Start ``command`` and send it ``signum`` once it has printed its first hypothesis and, when it
    ``has_children``, started a child process (a data-loader worker); checks that no child outlived it, its
    exit status and that it printed no traceback; returns its whole output and its stderr."""
    with open(tmp_path / "stderr", "w") as stderr_file:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        process, lines, reader = start_reading_until(command, "^H-", stderr_file, env=env, stdin=stdin)
        workers = wait_for_children(process.pid) if has_children else children(process.pid)
        try:
            process.send_signal(signum)
        finally:
            rest, survivors = finish(process, workers, reader)
    stderr = (tmp_path / "stderr").read_text()
    assert lines[-1].startswith("H-") and (workers or not has_children), stderr[-2000:]
    assert survivors == []
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert "Traceback" not in stderr
    return "".join(lines) + rest, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_fairseq_generate_stops_between_whole_batches(toy_model, tmp_path, signum):
    command = toy.fairseq_command("generate") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--user-dir", toy.PLUGIN_DIR,
        "--gen-subset", "train", "--beam", "1", "--batch-size", "1",  # fairseq's one data-loader worker
    ]
    output, stderr = stop_after_first_answer(command, tmp_path, signum)
    report = re.search(rf"fairseq-generate: stopped by {signum.name}; (\d+) of {TRAIN_SENTENCES} sentences were "
                       rf"written, each with all its lines; the other (\d+) were not", stderr)
    assert report, stderr[-2000:]
    assert 0 < int(report[1]) < TRAIN_SENTENCES and int(report[1]) + int(report[2]) == TRAIN_SENTENCES
    assert_whole_sentences(output, int(report[1]))
    assert "Generate train with beam=" not in output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_fairseq_interactive_stops_between_whole_buffers(toy_model, tmp_path, signum):
    command = toy.fairseq_command("interactive") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--user-dir", toy.PLUGIN_DIR,
        "--source-lang", toy.SRC, "--target-lang", toy.TGT, "--beam", "1", "--buffer-size", "4", "--batch-size", "2",
    ]
    with open(toy_model.raw / f"train.{toy.SRC}") as lines:
        # fairseq-interactive batches in its own process: no data-loader worker
        output, stderr = stop_after_first_answer(command, tmp_path, signum, stdin=lines, has_children=False)
    report = re.search(rf"fairseq-interactive: stopped by {signum.name}; the answers to (\d+) of the (\d+) input "
                       rf"lines read were written, each with all its lines; the other (\d+) lines were not answered",
                       stderr)
    assert report, stderr[-2000:]
    answered, read = int(report[1]), int(report[2])
    assert 0 < answered <= read < TRAIN_SENTENCES and answered % 4 == 0
    assert_whole_sentences(output, answered, kinds="SWHDP")


def wait_until_read(pipe, poll_s=0.05):
    """Until the process at the other end of ``pipe`` (a writable pipe) has read everything written to it."""
    unread = array.array("i", [0])
    while True:
        fcntl.ioctl(pipe.fileno(), termios.FIONREAD, unread)
        if unread[0] == 0:
            return
        time.sleep(poll_s)


def test_fairseq_interactive_stopped_while_a_buffer_fills_counts_its_lines(toy_model):
    """Three lines read into a buffer of 8, then SIGTERM: the report said "0 of the 0 input lines
    read" (fairseq's reader counted a buffer only once full); it counts the 3 lines read and not answered."""
    command = toy.fairseq_command("interactive") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--user-dir", toy.PLUGIN_DIR,
        "--source-lang", toy.SRC, "--target-lang", toy.TGT, "--beam", "1", "--buffer-size", "8",
    ]
    # the log and the output in one pipe: the prompt is logged once the model is loaded, before the first read
    process, _, reader = start_reading_until(command, "Type the input sentence", subprocess.STDOUT,
                                             stdin=subprocess.PIPE)
    try:
        lines = (toy_model.raw / f"test.{toy.SRC}").read_text().splitlines()[:3]
        process.stdin.write("\n".join(lines) + "\n")
        process.stdin.flush()
        wait_until_read(process.stdin)
        time.sleep(0.5)  # from the pipe to the reader's count: a loop over lines already in memory
        process.send_signal(signal.SIGTERM)
    finally:
        output, _ = finish(process, [], reader)
    assert process.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert "Traceback" not in output and not re.search("^H-", output, re.M)
    reports = [line for line in output.splitlines() if line.startswith("fairseq-interactive: stopped")]
    assert reports == ["fairseq-interactive: stopped by SIGTERM; the answers to 0 of the 3 input lines read were "
                       "written, each with all its lines; the other 3 lines were not answered"], output[-2000:]
