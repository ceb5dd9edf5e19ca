"""Fixtures of the server tests: fairseq-interactive's answers to compare with, and a running server."""

import os
import re
import subprocess

import pytest

from fairseq_fastgen.commands import fairseq_command
from tests.serve.servers import SENTENCES, Server, model_options

@pytest.fixture(scope="session")
def sources(toy_model):
    return (toy_model.raw / "test.en").read_text().split("\n")[:SENTENCES]


def interactive_answers(toy_model, plugin_dir, sources, *options):
    """fairseq-interactive's answers with greedy-stream (and ``options``): source text -> (D- text, H- text, score)."""
    command = fairseq_command("interactive") + model_options(toy_model, plugin_dir) + [
        "--decoder", "greedy-stream", "--beam", "1", "--buffer-size", "16", "--batch-size", "8", *options]
    completed = subprocess.run(command, input="\n".join(sources) + "\n", capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    hypotheses = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", completed.stdout, flags=re.M))
    answers = {}
    for sentence, score, text in re.findall(r"^D-(\d+)\t(\S+)\t(.*)$", completed.stdout, flags=re.M):
        answers[sources[int(sentence)]] = (text, hypotheses[sentence], float(score))
    assert len(answers) == len(set(sources))
    return answers


@pytest.fixture(scope="session")
def offline(toy_model, plugin_dir, sources):
    """fairseq-interactive's answers with greedy-stream: source text -> (D- text, H- text, score)."""
    return interactive_answers(toy_model, plugin_dir, sources)


@pytest.fixture(scope="module")
def server(toy_model, plugin_dir, tmp_path_factory):
    """Continuous batching with greedy-stream, a running batch of 8 sentences, small limits to refuse against."""
    running = Server(toy_model, plugin_dir, tmp_path_factory.mktemp("server"),
                     "--decoder", "greedy-stream", "--beam", "1", "--batch-size", "8",
                     "--max-sentences-per-request", "8", "--max-source-tokens", "40", "--max-request-bytes", "65536",
                     "--max-queue", "256")
    yield running
    status, _ = running.stop()
    assert status == 0, running.log()[-3000:]


