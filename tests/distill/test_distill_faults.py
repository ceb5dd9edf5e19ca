"""Fastgen-distill under signals, kills and damaged files, through its real command."""

import os
import random
import re
import shutil
import signal
import subprocess

import pytest

from fairseq_fastgen.safe_files import KILL_AT_WRITE_STEP_ENV
from tests.distill.distill_runs import ONE_THREAD, REFERENCE_ARGS, SPLIT, distill_command, run_distill
from tests.processes import children, finish

pytestmark = pytest.mark.xdist_group("toy_distill")

SUMMARY = f"distill.{SPLIT}.json"  # holds timings: the one file of OUT that differs between runs


def data_bin_files(out):
    """{name: bytes} of every file of OUT but the summary (the data-bin, its record; temporary files too)."""
    return {path.name: path.read_bytes() for path in out.iterdir() if path.is_file() and path.name != SUMMARY}


@pytest.fixture(scope="module")
def listed_run(toy_model, tmp_path_factory):
    """An uninterrupted run that lists its write steps (the points where the fault runs are killed)."""
    out = tmp_path_factory.mktemp("faults") / "uninterrupted"
    completed = run_distill(toy_model, out, *REFERENCE_ARGS, env={**ONE_THREAD, KILL_AT_WRITE_STEP_ENV: "0"})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    steps = re.findall(r"^write step \d+: (.*)$", completed.stderr, flags=re.MULTILINE)
    return out, steps


def kill_step(steps, seed):
    """The write step that run ``seed`` is killed at: the first seeds in the copy of the other splits and
    in the merge (the distilled targets), the others anywhere."""
    rng = random.Random(seed)
    phases = [lambda step: "train.en-fr" in step, lambda step: "targets written" in step or "valid.en-fr.fr" in step]
    in_phase = phases[seed] if seed < len(phases) else (lambda step: True)
    return rng.choice([number for number, step in enumerate(steps, 1) if in_phase(step)])


@pytest.mark.parametrize("seed", range(6))
def test_a_run_killed_at_any_write_resumes_to_the_same_data_bin(listed_run, toy_model, tmp_path, seed):
    uninterrupted, steps = listed_run
    assert len(steps) > 20  # shards, copies, records: every file goes through one
    step = kill_step(steps, seed)
    out = tmp_path / "out"
    killed = run_distill(toy_model, out, *REFERENCE_ARGS, env={**ONE_THREAD, KILL_AT_WRITE_STEP_ENV: str(step)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"write step {step}: {steps[step - 1]}" in killed.stderr

    resumed = run_distill(toy_model, out, *REFERENCE_ARGS, env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert data_bin_files(out) == data_bin_files(uninterrupted)


def test_a_truncated_copy_of_another_split_is_copied_again(reference_run, toy_model, tmp_path):
    """A copy cut short by a kill (before copies were atomic) stayed partial for good: the rerun kept it."""
    out = tmp_path / "out"
    shutil.copytree(reference_run.out, out)
    copied = out / "train.en-fr.fr.bin"
    copied.write_bytes(copied.read_bytes()[:1000])
    rerun = run_distill(toy_model, out, *REFERENCE_ARGS, env=ONE_THREAD)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert copied.read_bytes() == (toy_model.data_bin / copied.name).read_bytes()
    assert re.search(rf"{copied} is damaged \(1000 bytes where \d+ were written\); copying", rerun.stdout)


def test_a_damaged_shard_is_named_in_one_error_line(reference_run, toy_model, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference_run.out / "distill-shards", out / "distill-shards")
    shard = out / "distill-shards" / SPLIT / "shard-00002-of-00004.npz"
    shard.write_bytes(shard.read_bytes()[:300])
    rerun = run_distill(toy_model, out, *REFERENCE_ARGS, env=ONE_THREAD)
    output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if " | ERROR | " in line]
    assert len(errors) == 1 and f"shard file {shard} is damaged (BadZipFile" in errors[0], output[-3000:]
    assert not (out / f"{SPLIT}.en-fr.fr.bin").exists()


def test_sigterm_ends_the_workers_and_reports_the_shards_done(toy_model, tmp_path):
    """SIGTERM left the workers decoding as orphans."""
    out = tmp_path / "out"
    args = ["--split", SPLIT, "--beam", "2", "--batch-size", "1", "--num-shards", "8", "--cpu", "--no-progress-bar",
            "--workers", "2"]
    command = distill_command() + [str(toy_model.data_bin), "--path", str(toy_model.checkpoint),
                                   "--output-dir", str(out), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **ONE_THREAD)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in iter(process.stdout.readline, ""):
        lines.append(line)
        if re.search(r"worker \d: shard \d/8 done", line):
            break
    workers = [pid for pid in children(process.pid) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
    try:
        process.send_signal(signal.SIGTERM)
    finally:
        rest, survivors = finish(process, workers)
    output = "".join(lines) + rest
    assert len(workers) == 2 and survivors == []
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    report = re.search(r"fastgen-distill: stopped by SIGTERM; (\d) of 8 shards of 'valid' are done and kept", output)
    assert report and int(report[1]) >= 1, output[-3000:]
    # the workers' data loaders left their semaphores to the resource tracker, which said so
    assert "leaked semaphore" not in output, output[-3000:]
    assert not (out / f"{SPLIT}.en-fr.fr.bin").exists()
    resumed = run_distill(toy_model, out, *args, env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming: {report[1]} of 8 shards of 'valid' already done" in resumed.stdout
