"""Running fastgen-distill in the tests, and reading what it wrote."""

import os
import subprocess
import sys
from pathlib import Path

from fairseq.data import data_utils

SPLIT = "valid"
# beam search in 4 shards of 50 sentences, batches of up to 16 sentences inside each shard
REFERENCE_ARGS = ["--split", SPLIT, "--beam", "2", "--batch-size", "16", "--num-shards", "4",
                  "--cpu", "--no-progress-bar"]
# every worker with one thread, so that runs with 1 and 2 processes compute alike
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def distill_command():
    """The installed console script, or the module when the package is not installed."""
    script = Path(sys.executable).parent / "fastgen-distill"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fairseq_fastgen.distill"]


def run(cmd, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def run_distill(toy_model, out_dir, *args, env=None, launcher=None):
    cmd = (launcher or distill_command()) + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--output-dir", str(out_dir), *args
    ]
    return run(cmd, env=env)


def read_tokens(data_bin, split, lang):
    """Every sentence of a binarized split as a list of token ids."""
    dataset = data_utils.load_indexed_dataset(str(Path(data_bin) / f"{split}.en-fr.{lang}"), None)
    return [dataset[i].tolist() for i in range(len(dataset))]


def same_bytes(first: Path, second: Path) -> bool:
    return first.read_bytes() == second.read_bytes()
