"""fastgen-serve's command line: every server option in --help; each misuse one error line, exit status 2, before
the model loads."""

import os
import subprocess

import pytest

from tests.serve.servers import model_options, serve_command

SERVER_OPTIONS = ["--host", "--port", "--batching", "--fixed-batch-size", "--fixed-batch-wait-ms",
                  "--max-sentences-per-request", "--max-source-tokens", "--max-queue", "--retry-after",
                  "--request-timeout", "--grace-period", "--max-request-bytes", "--ray-replicas", "--ray-address",
                  "--ray-cpus-per-replica", "--peer"]


def run(*arguments):
    return subprocess.run(serve_command() + list(arguments), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_help_lists_every_server_option_and_fairseq_interactives():
    completed = run("--help")
    assert completed.returncode == 0
    for option in SERVER_OPTIONS + ["--decoder", "--bpe", "--tokenizer", "--path"]:
        assert option in completed.stdout, option


@pytest.mark.parametrize("arguments, message", [
    (["--port", "70000"], "--port must be in 0..65535; got 70000"),
    (["--batching", "sometimes"], "argument --batching: invalid choice: 'sometimes'"),
    (["--decoder", "greedy", "--beam", "1"], "--batching continuous runs one stream across requests, which "
                                             "--decoder greedy does not"),
    (["--peer", "ctranslate2", "--decoder", "greedy-stream", "--beam", "1"],
     "--peer ctranslate2 decodes fixed batches (it cannot take sentences into a batch that is decoding): add "
     "--batching fixed"),
    (["--peer", "ctranslate2", "--batching", "fixed", "--decoder", "blockwise", "--beam", "1"],
     "--peer ctranslate2 decodes with greedy or beam search, not --decoder blockwise"),
    (["--ray-replicas", "-1"], "--ray-replicas must be >= 0; got -1"),
    (["--ray-replicas", "2", "--port", "0"], "--ray-replicas needs a --port"),
    (["--ray-replicas", "2", "--port", "8000", "--decoder", "greedy", "--beam", "1"],
     "--batching continuous runs one stream across requests"),  # checked before any replica starts
])
def test_misuse_is_one_line(toy_model, plugin_dir, arguments, message):
    completed = run(*model_options(toy_model, plugin_dir), *arguments)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1] == f"fastgen-serve: error: {message}" or \
        completed.stderr.strip().splitlines()[-1].startswith(f"fastgen-serve: error: {message}")
    assert "Traceback" not in completed.stderr
    assert sum(": error:" in line for line in completed.stderr.splitlines()) == 1
