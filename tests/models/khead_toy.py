"""Toy k-head checkpoints (trained once by the real fairseq-train, cached like
the toy transformer), all on the toy corpus of the ``toy_model`` fixture:

* ``k4``: 4 heads warm started from the toy transformer with ``--freeze-base``
  (head 1 = base output + a learned offset);
* ``k2``: 2 heads warm started with ``--khead-identity-first --freeze-base``
  (head 1 is the toy transformer's output);
* ``two_ranks``: a smaller 4-head model trained from scratch for 2 epochs by
  two data-parallel processes (gloo, CPU), validated every epoch; each rank
  saves its parameters beside the checkpoint (train_and_dump_ranks.py).
"""

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_fastgen.criterions import random_subloss
from fairseq_fastgen.models import transformer_khead
from fastgen_demo import synthetic, toy

HERE = Path(__file__).resolve().parent
CRITERION_ARGS = ["--criterion", "random_subloss", "--label-smoothing", "0.1"]


@dataclass
class KHeadToy:
    block_size: int
    checkpoint: Path
    train_log: Path
    data_bin: Path


def warm_start_spec(base_checkpoint, *khead_args):
    return toy.ToyModelSpec(
        arch="transformer_khead", max_update=60, validate_interval=1000,
        extra_args=["--freeze-base", "--base-checkpoint", str(base_checkpoint)] + list(khead_args),
    )


def build(name, block_size, spec, toy_model) -> KHeadToy:
    key = [toy.source_fingerprint(toy, synthetic, transformer_khead, random_subloss), repr(spec), toy_model.root.name]

    def train(out_dir):
        toy.train(toy_model.data_bin, out_dir, spec, criterion_args=CRITERION_ARGS)

    root = toy.cached_build(name, key, train)
    return KHeadToy(block_size, root / "checkpoint_last.pt", root / "train.log", toy_model.data_bin)


def build_k4(toy_model) -> KHeadToy:
    return build("toy-khead-k4", 4, warm_start_spec(toy_model.checkpoint, "--block-size", "4"), toy_model)


def build_k2(toy_model) -> KHeadToy:
    spec = warm_start_spec(toy_model.checkpoint, "--block-size", "2", "--khead-identity-first")
    return build("toy-khead-k2", 2, spec, toy_model)


TWO_RANKS_SPEC = toy.ToyModelSpec(
    arch="transformer_khead", layers=1, dim=32, ffn=64, max_update=0, warmup=10,
    extra_args=["--block-size", "4", "--max-epoch", "2", "--distributed-world-size", "2", "--distributed-no-spawn",
                "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"],
)


def build_two_ranks(toy_model) -> Path:
    """Directory with checkpoint_last.pt, rank0.pt, rank1.pt and each rank's log."""
    key = [toy.source_fingerprint(toy, synthetic, transformer_khead, random_subloss), repr(TWO_RANKS_SPEC),
           toy_model.root.name, (HERE / "train_and_dump_ranks.py").read_text()]
    return toy.cached_build("toy-khead-two-ranks", key, lambda out: train_two_ranks(toy_model.data_bin, out))


def train_two_ranks(data_bin, save_dir):
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, str(HERE / "train_and_dump_ranks.py"), str(data_bin), "--user-dir", toy.PLUGIN_DIR,
           "--save-dir", str(save_dir), "--cpu", "--num-workers", "0", "--no-epoch-checkpoints",
           "--log-format", "simple", "--no-progress-bar", "--distributed-init-method", f"tcp://localhost:{port}"]
    cmd += TWO_RANKS_SPEC.train_args() + CRITERION_ARGS
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    logs = [open(Path(save_dir) / f"rank{rank}.log", "w") for rank in range(2)]
    ranks = [subprocess.Popen(cmd + ["--distributed-rank", str(rank)], stdout=log, stderr=subprocess.STDOUT, env=env)
             for rank, log in enumerate(logs)]
    codes = [process.wait() for process in ranks]
    for log in logs:
        log.close()
    if any(codes):
        tails = [(Path(save_dir) / f"rank{rank}.log").read_text()[-2000:] for rank in range(2)]
        raise RuntimeError(f"two-rank training failed with exit codes {codes}:\n" + "\n".join(tails))


def build_in_process(data_bin, *model_args, spec=None):
    """Build (untrained) a model from fairseq-train arguments; returns (model, task)."""
    spec = spec or toy.ToyModelSpec(arch="transformer_khead")
    cli = [str(data_bin), "--user-dir", toy.PLUGIN_DIR, "--cpu"] + spec.train_args() + list(model_args)
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), cli))
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model).eval(), task



def randomized_heads(data_bin, block_size, seed=0):
    """An untrained model of the toy dimensions whose head layer is random (its
    fc2 starts at zero, which would make every head equal)."""
    torch.manual_seed(seed)
    model, task = build_in_process(data_bin, "--block-size", str(block_size))
    torch.nn.init.normal_(model.decoder.heads.fc2.weight, std=0.1)
    torch.nn.init.normal_(model.decoder.heads.fc2.bias, std=0.1)
    return model, task

# ---- fixtures (imported by the conftest.py of the test directories that use them) ----------
@pytest.fixture(scope="session")
def khead_k2(toy_model) -> KHeadToy:
    return build_k2(toy_model)


@pytest.fixture(scope="session")
def khead_k4(toy_model) -> KHeadToy:
    return build_k4(toy_model)


@pytest.fixture(scope="session")
def two_ranks(toy_model) -> Path:
    return build_two_ranks(toy_model)


@pytest.fixture(scope="module")
def one_thread():
    """The machines running the tests are shared: one torch thread per test process
    avoids oversubscribed (and then very slow) thread pools."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
