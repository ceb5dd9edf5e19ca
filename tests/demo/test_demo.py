"""``make demo``'s table step on the test fixtures' toy models: every method's rows, its summary lines,
the paths it names, and no library noise (sacrebleu's "forgot to detokenize" warning)."""

import logging

import pytest

from fastgen_demo import demo
from tests.models.khead_toy import khead_k4  # noqa: F401  (fixture)

EXPECTED_ROWS = [
    "greedy/b1/bs1", "blockwise/b1/bs1", "greedy/b1/bs64", "blockwise/b1/bs64",
    "beam/b5/bs64", "beam/b5/bs64/cp", "var-batch/b5/bs64", "var-batch/b5/bs64/cp",
    "var-stream/b5/bs64", "var-stream/b5/bs64/cp",
]


@pytest.fixture(scope="module")
def demo_run(toy_model, khead_k4, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("demo")
    clusters = out / "toy.clusters.pt"
    demo.train_clusters(toy_model.data_bin, toy_model.checkpoint, clusters, clusters=8, states=2000)
    models = demo.DemoModels(toy_model.data_bin, toy_model.checkpoint, khead_k4.checkpoint, clusters)
    return out, models


@pytest.mark.xdist_group("demo")
def test_demo_table_step_shows_every_method_without_library_noise(demo_run, capfd, caplog):
    out, models = demo_run
    caplog.set_level(logging.WARNING)
    # the whole toy test split (200 sentences): sacrebleu warns from 100 tokenized-looking lines on
    text = demo.table_step(models, out, repeat=1)
    captured = capfd.readouterr()
    printed = captured.out + captured.err

    table_labels = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    for label in EXPECTED_ROWS:
        assert label in table_labels, f"{label} missing from the demo table:\n{text}"
    method_lines = [line for line in text.splitlines() if line.startswith("- ")]
    for method in ("blockwise (k=4 student", "variable-width beam search: var-batch ",
                   "cluster-projected vocabulary: stock beam 5 with it: "):
        assert sum(line.startswith(f"- {method}") for line in method_lines) == 1, (method, text)
    peer_lines = [line for line in method_lines if line.startswith(("- against CTranslate2", "- CTranslate2: not"))]
    assert len(peer_lines) == 1, text
    assert "x greedy's sentences/s at batch 1" in text and "no row" not in text
    for run in ("latency", "throughput"):
        assert (out / "bench" / run / "results.json").is_file()
        assert f"{out / 'bench' / run}/bleu_vs_speed.png" in text
        assert (out / "bench" / run / "bleu_vs_speed.png").is_file()
    assert (out / "demo.md").read_text() == text + "\n"
    logged = [record.getMessage() for record in caplog.records]  # what a configured logger would print
    assert not [message for message in logged if "forgot to detokenize" in message]
    assert "forgot to detokenize" not in printed
    assert "Traceback" not in printed
