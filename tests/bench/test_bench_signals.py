"""SIGTERM and SIGINT to fastgen-bench end the run and every process it started (a --whole-process
pass's fairseq-generate, and that one's data-loader worker), say on stderr how many passes were run, write no
results and exit with status 128 + the signal.  Before, SIGTERM ended the bench at once (status -15) and left the
fairseq-generate process of the pass under way running; SIGINT ended it with a traceback."""

import os
import re
import signal
import subprocess

import pytest

from tests.bench.test_bench_cli import bench_command
from tests.processes import finish, start_reading_until, wait_for_descendants

pytestmark = pytest.mark.xdist_group("test_bench_signals")


def start_bench(toy_model, output_dir, *extra):
    """fastgen-bench greedy over the toy's 4000 training sentences, one per batch (long after its first pass
    starts), once it has logged the start of its first warm-up pass; its log shares the output pipe."""
    command = bench_command() + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1", "--decoders", "greedy",
        "--beam", "1", "--batch-size", "1", "--subset", "train", "--repeat", "1", "--no-ctranslate2",
        "--no-progress-bar", "--output-dir", str(output_dir), *extra,
    ]
    return start_reading_until(command, r"\| fastgen_bench \| warm-up greedy/b1/bs1$", subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("whole_process", [False, True], ids=["in-process", "whole-process"])
def test_a_signal_ends_the_bench_and_every_process_it_started(toy_model, tmp_path, signum, whole_process):
    output_dir = tmp_path / "out"
    process, lines, reader = start_bench(toy_model, output_dir, *(["--whole-process"] if whole_process else []))
    started = []
    if whole_process:  # once the pass's fairseq-generate decodes: it has started its data-loader worker
        started = wait_for_descendants(process.pid, 2)
    try:
        process.send_signal(signum)
    finally:
        rest, survivors = finish(process, started, reader)
    output = "".join(lines) + rest
    assert lines[-1].rstrip().endswith("warm-up greedy/b1/bs1"), output[-2000:]
    assert len(started) == (2 if whole_process else 0) and survivors == []
    assert process.returncode == 128 + signum, output[-2000:]
    assert "Traceback" not in output
    passes = 4 if whole_process else 2  # a warm-up and a timed pass of greedy (and of stock fairseq-generate)
    assert re.search(rf"^fastgen-bench: stopped by {signum.name}; 0 of {passes} passes were run \(warm-up "
                     rf"greedy/b1/bs1 under way\); no results were written$", output, re.MULTILINE), output[-2000:]
    assert not output_dir.exists()
