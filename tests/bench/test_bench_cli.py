"""Fastgen-bench on the toy model, through the real console script and in process."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from fairseq_fastgen import bench
from fairseq_fastgen.bench.ctranslate2_peer import import_ctranslate2
from fairseq_fastgen.safe_files import KILL_AT_WRITE_STEP_ENV
from fairseq_fastgen.registry import DECODERS, register_builder

pytestmark = pytest.mark.xdist_group("test_bench_cli")

SENTENCES = 16  # ids 0..15 of the toy test set: enough for every batch to be full, quick to decode
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NEVER = 10**9  # a write step no run reaches: every step is listed, none killed


def bench_command():
    script = Path(sys.executable).parent / "fastgen-bench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fairseq_fastgen.bench"]


def common_args(toy_model, output_dir, decoders, repeat):
    return [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1",
        "--decoders", ",".join(decoders), "--beam", "1", "--batch-size", "8", "--repeat", str(repeat),
        "--max-sentences", str(SENTENCES), "--output-dir", str(output_dir),
    ]


def reference_lines(toy_model):
    """Targets of sentences 0..SENTENCES-1 as fairseq prints them: words outside the dictionary escaped."""
    dictionary = {line.split()[0] for line in (toy_model.data_bin / "dict.fr.txt").read_text().splitlines()}
    lines = (toy_model.raw / "test.fr").read_text().splitlines()[:SENTENCES]
    return [" ".join(w if w in dictionary else "<<unk>>" for w in line.split()) for line in lines]


def read_hypotheses(path):
    rows = [line.split("\t") for line in Path(path).read_text().splitlines()]
    return {int(i): text for i, text in rows}


@pytest.fixture(scope="module")
def cli_run(toy_model, tmp_path_factory):
    """One real fastgen-bench run: beam and greedy; every write step listed on stderr (never killed)."""
    output_dir = tmp_path_factory.mktemp("bench")
    completed = subprocess.run(
        bench_command() + common_args(toy_model, output_dir, ["beam", "greedy"], repeat=2), capture_output=True,
        text=True, env=dict(os.environ, **{KILL_AT_WRITE_STEP_ENV: str(NEVER)}),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((output_dir / "results.json").read_text())
    return completed, results, output_dir


def by_label(results):
    return {config["label"]: config for config in results["configurations"]}


def test_json_reports_every_measured_field(cli_run, toy_model):
    completed, results, _ = cli_run
    configs = by_label(results)
    assert results["sentences"] == SENTENCES and results["repeat"] == 2
    # the loaded model's shape, for the x labels of --plot-sizes
    model = results["model"]
    assert model["parameters"] > 0 and model["encoder_layers"] >= 1 and model["decoder_layers"] >= 1
    assert model["width"] >= 1
    for label in ("beam/b1/bs8", "greedy/b1/bs8"):
        config = configs[label]
        assert config["status"] == "ok"
        assert config["sentences"] == SENTENCES
        assert len(config["seconds"]) == 2 and min(config["seconds"]) > 0
        for rate, count in (("sentences_per_second", SENTENCES), ("tokens_per_second", config["generated_tokens"])):
            speeds = config[rate]
            assert speeds["min"] <= speeds["median"] <= speeds["max"]
            assert math.isclose(speeds["max"], count / min(config["seconds"]))
        assert config["generated_tokens"] > SENTENCES  # every hypothesis has a word and eos
        assert config["memory"]["cpu_peak_rss_mib"] > 0
        assert config["memory"]["cpu_peak_scope"] in ("configuration", "process")
        assert label in completed.stdout  # one row of the Markdown table
    # the plugin decoder reports its counters; stock beam search has none
    greedy_stats = configs["greedy/b1/bs8"]["statistics"]
    assert greedy_stats["decoder"] == "greedy" and greedy_stats["sentences"] == SENTENCES
    assert greedy_stats["iterations"] >= max(1, configs["greedy/b1/bs8"]["generated_tokens"] // SENTENCES)
    assert configs["beam/b1/bs8"]["statistics"] == {}
    # a missing CTranslate2 is a note; an installed one is measured beside fairseq
    if import_ctranslate2()[0] is None:
        assert any("CTranslate2 is not installed" in note for note in results["notes"])
        assert "Note: CTranslate2 is not installed" in completed.stdout
    else:
        assert "ctranslate2/b1/bs8" in configs


def test_bleu_and_identical_outputs_match_the_written_hypotheses(cli_run, toy_model):
    _, results, _ = cli_run
    configs = by_label(results)
    references = reference_lines(toy_model)
    stock = read_hypotheses(configs["beam/b1/bs8"]["hypotheses"])
    greedy = read_hypotheses(configs["greedy/b1/bs8"]["hypotheses"])
    assert sorted(stock) == list(range(SENTENCES))
    for label, hypotheses in (("beam/b1/bs8", stock), ("greedy/b1/bs8", greedy)):
        expected = sacrebleu.corpus_bleu([hypotheses[i] for i in range(SENTENCES)], [references]).score
        assert configs[label]["bleu"] == pytest.approx(expected, abs=1e-9)
    # greedy is token-identical to stock --beam 1 (foundation guarantee), and the bench says so
    assert configs["greedy/b1/bs8"]["reference"] == "beam/b1/bs8"
    same = sum(greedy[i] == stock[i] for i in range(SENTENCES)) / SENTENCES
    assert configs["greedy/b1/bs8"]["identical_rate"] == same == 1.0


def test_plot_is_a_readable_png(cli_run):
    _, results, output_dir = cli_run
    plot = Path(results["plots"][0])
    assert plot.parent == output_dir and plot.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    from PIL import Image

    with Image.open(plot) as image:
        image.verify()
    from matplotlib import image as matplotlib_image

    pixels = matplotlib_image.imread(plot)  # (height, width, channels)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_every_file_is_written_to_a_temporary_name_and_renamed(cli_run):
    """The hypotheses and the plot were written in place, so a stopped or killed bench could leave
    them cut short."""
    completed, _, output_dir = cli_run
    written = [path.relative_to(output_dir) for path in output_dir.rglob("*") if path.is_file()]
    assert len(written) >= 5  # results.json, results.md, the plot, a hypotheses file per configuration
    for path in written:
        assert f"{path.name} written to its temporary file" in completed.stderr, path
        assert f"{path.name} renamed" in completed.stderr, path
    assert not [path for path in written if path.name.endswith(".tmp")]


@pytest.fixture
def refusing_decoder():
    """A decoder registered for this test only, which refuses every batch while decoding (a refusal when the
    decoder is built is a misuse: tests/test_usage_errors.py)."""
    name = "bench-test-refuses"

    class RefusingGenerator:
        def generate(self, models, sample, **kwargs):
            raise ValueError("this decoder does not apply to this model")

    register_builder(name, lambda models, tgt_dict, gen_cfg, **extra: RefusingGenerator(),
                     guarantee="test decoder that refuses every batch")
    yield name
    del DECODERS[name]


def test_a_decoder_that_refuses_while_decoding_is_reported_as_skipped(toy_model, tmp_path, capsys, refusing_decoder):
    extra = ["--no-ctranslate2", "--no-progress-bar", "--variant", "short=--max-len-b 3"]
    results = bench.main(common_args(toy_model, tmp_path, ["greedy", refusing_decoder], repeat=1) + extra)
    outcome = {r.config.label: r for r in results}
    assert outcome["greedy/b1/bs8"].ok and len(outcome["greedy/b1/bs8"].outputs) == SENTENCES
    for label in (f"{refusing_decoder}/b1/bs8", f"{refusing_decoder}/b1/bs8/short"):
        assert outcome[label].skipped == "this decoder does not apply to this model"
    written = by_label(json.loads((tmp_path / "results.json").read_text()))
    assert written[f"{refusing_decoder}/b1/bs8"] == {
        "label": f"{refusing_decoder}/b1/bs8", "decoder": refusing_decoder, "beam": 1, "batch_size": 8,
        "max_tokens": None, "cluster_projection": False, "variant": None, "status": "skipped",
        "reason": "this decoder does not apply to this model",
    }
    # without stock beam in the run, the first configuration is the reference
    assert written["greedy/b1/bs8"]["reference"] == "greedy/b1/bs8"
    assert "skipped: this decoder does not apply to this model" in capsys.readouterr().out
    # a variant's generation options reach the decoder: at most 3 tokens before eos
    short = outcome["greedy/b1/bs8/short"].outputs
    assert max(len(tokens) for tokens in short.values()) == 4
    assert max(len(tokens) for tokens in outcome["greedy/b1/bs8"].outputs.values()) > 4


def test_unknown_decoders_are_refused_with_the_registered_names(capsys):
    with pytest.raises(SystemExit):
        bench.main(["data-bin", "--path", "model.pt", "--decoders", "beam,no-such-decoder"])
    error = capsys.readouterr().err
    assert "unknown decoder(s) no-such-decoder" in error
    assert "registered: " + ", ".join(DECODERS) in error
