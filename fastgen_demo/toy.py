"""The embedded default: a synthetic corpus, binarized, and a tiny transformer.

Used by ``make demo`` and by the test fixtures.  Every step calls the real
fairseq command line tools (fairseq-preprocess, fairseq-train), as a user would.
"""

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

# the runtime's command lines and artifact cache, which the test fixtures reach through this module too
from fairseq_fastgen.commands import PLUGIN_DIR, fairseq_command, stock_fairseq_command  # noqa: F401
from fairseq_fastgen.safe_files import cached_build  # noqa: F401
from fastgen_demo.synthetic import generate_corpus

SRC, TGT = "en", "fr"


@dataclass
class ToyModelSpec:
    """A tiny base transformer; the defaults train in well under a minute on 2 cores."""

    layers: int = 2
    dim: int = 64
    ffn: int = 128
    heads: int = 2
    max_positions: int = 64
    max_update: int = 300
    validate_interval: int = 1  # epochs between validations / checkpoint saves
    max_tokens: int = 4000
    lr: float = 0.005
    warmup: int = 100
    seed: int = 1
    arch: str = "transformer"
    extra_args: List[str] = field(default_factory=list)

    def train_args(self) -> List[str]:
        return [
            "--arch", self.arch,
            "--encoder-layers", str(self.layers), "--decoder-layers", str(self.layers),
            "--encoder-embed-dim", str(self.dim), "--decoder-embed-dim", str(self.dim),
            "--encoder-ffn-embed-dim", str(self.ffn), "--decoder-ffn-embed-dim", str(self.ffn),
            "--encoder-attention-heads", str(self.heads), "--decoder-attention-heads", str(self.heads),
            "--max-source-positions", str(self.max_positions), "--max-target-positions", str(self.max_positions),
            "--share-decoder-input-output-embed",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
            "--lr", str(self.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(self.warmup),
            "--dropout", "0.1", "--max-tokens", str(self.max_tokens), "--max-update", str(self.max_update),
            "--seed", str(self.seed),
            "--validate-interval", str(self.validate_interval), "--save-interval", str(self.validate_interval),
        ] + list(self.extra_args)


PROGRESS_MARKERS = (" | train_inner | ", " | train | ", " | valid | ", "done training")  # fairseq-train's progress lines


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_this_process():
    """In a child before it runs its command (``preexec_fn``): on Linux the kernel sends it SIGTERM when the
    process that started it ends, however it ends, so that a killed demo or test run leaves no fairseq-train
    running on its own."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run(cmd, log_path=None, show_progress=False):
    """Run a command, which ends if this process is killed; on failure raise with the tail of its output.

    With ``show_progress`` the command's progress lines (fairseq-train's
    training and validation statistics) are echoed as they come, without
    fairseq's configuration and model dumps."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if show_progress:
        lines = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=end_with_this_process) as process:
            for line in process.stdout:
                lines.append(line)
                if any(marker in line for marker in PROGRESS_MARKERS):
                    print("   " + line.split(" | ", 1)[-1].rstrip(), flush=True)
        completed = subprocess.CompletedProcess(cmd, process.returncode)
        output = "".join(lines)
    else:
        completed = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=end_with_this_process)
        output = completed.stdout + completed.stderr
    if log_path:
        Path(log_path).write_text(output)
    if completed.returncode != 0:
        raise RuntimeError(f"command failed ({completed.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
    return output


def make_corpus(raw_dir, n_train=20000, n_valid=500, n_test=500, seed=1):
    return generate_corpus(raw_dir, n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed, src=SRC, tgt=TGT)


def binarize(raw_dir, bin_dir, joined_dictionary=False):
    cmd = fairseq_command("preprocess") + [
        "--source-lang", SRC, "--target-lang", TGT,
        "--trainpref", f"{raw_dir}/train", "--validpref", f"{raw_dir}/valid", "--testpref", f"{raw_dir}/test",
        "--destdir", str(bin_dir), "--workers", "1",
    ]
    if joined_dictionary:
        cmd.append("--joined-dictionary")
    run(cmd, log_path=Path(bin_dir).parent / "preprocess.log")
    return bin_dir


def train(bin_dir, save_dir, spec: ToyModelSpec, show_progress=False, criterion_args=None, device="cpu"):
    """fairseq-train ``spec`` on ``device``: "cpu", or "cuda" with mixed precision (``--amp``: the weights and the
    checkpoint stay float32)."""
    criterion_args = criterion_args or ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    placement = ["--cpu"] if device == "cpu" else ["--amp"]
    cmd = fairseq_command("train") + [
        str(bin_dir), "--user-dir", PLUGIN_DIR, "--save-dir", str(save_dir),
        "--num-workers", "0", "--no-epoch-checkpoints",
        "--log-format", "simple", "--log-interval", "50",
    ] + placement + spec.train_args() + criterion_args
    if not show_progress:
        cmd.append("--no-progress-bar")
    run(cmd, log_path=Path(save_dir) / "train.log", show_progress=show_progress)
    return Path(save_dir) / "checkpoint_last.pt"


def source_fingerprint(*modules) -> str:
    """Hash of the source files an artifact depends on (rebuild when they change)."""
    return hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in modules)).hexdigest()


def build_toy_model(out_dir, spec: ToyModelSpec, n_train=4000, n_valid=200, n_test=200):
    """Corpus, data-bin and a trained checkpoint under ``out_dir``."""
    out_dir = Path(out_dir)
    make_corpus(out_dir / "raw", n_train=n_train, n_valid=n_valid, n_test=n_test)
    binarize(out_dir / "raw", out_dir / "bin")
    (out_dir / "ckpt").mkdir(exist_ok=True)
    train(out_dir / "bin", out_dir / "ckpt", spec)
