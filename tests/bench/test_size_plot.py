"""Fastgen-bench --plot-sizes, speed against model size beside CTranslate2, from results.json files
written as the bench writes them (report.write_json, bench.run_info), through the real console script."""

import argparse
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from fairseq_fastgen import bench
from fairseq_fastgen.bench import main as bench_main
from fairseq_fastgen.bench import report, size_plot
from fairseq_fastgen.bench.measure import ConfigResult
from fairseq_fastgen.bench.options import BenchConfig
from tests.bench.test_bench_cli import PNG_MAGIC, bench_command
from tests.test_usage_errors import assert_one_error_line

SENTENCES = 10
# size -> (encoder layers, decoder layers, width) of its model; label -> seconds of its timed passes, or None:
# skipped.  Sentences/s = SENTENCES / seconds (median): toy greedy 20, CTranslate2 at beam 1 40 -> 0.50x.
SIZES = {
    "toy": ((2, 1, 16), {"greedy/b1/bs8": [0.5, 0.4, 0.6], "beam/b5/bs8": [1.0],
                         "ctranslate2/b1/bs8": [0.25], "ctranslate2/b5/bs8": [2.0]}),
    # CTranslate2 declined beam 5: beam/b5/bs8 has no ratio
    "base": ((3, 3, 32), {"greedy/b1/bs8": [1.0], "beam/b5/bs8": [2.0],
                          "ctranslate2/b1/bs8": [0.5], "ctranslate2/b5/bs8": None}),
    # a --no-ctranslate2 run
    "big": ((4, 4, 32), {"greedy/b1/bs8": [4.0], "beam/b5/bs8": [5.0]}),
}


def tiny_transformer(encoder_layers, decoder_layers, width):
    """A fairseq transformer of this shape (random weights): what fastgen-bench loads, for run_info's model."""
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, base_architecture

    dictionary = Dictionary()
    for word in "abcdefgh":
        dictionary.add_symbol(word)
    args = argparse.Namespace(encoder_layers=encoder_layers, decoder_layers=decoder_layers, encoder_embed_dim=width,
                              decoder_embed_dim=width, encoder_ffn_embed_dim=2 * width,
                              decoder_ffn_embed_dim=2 * width, encoder_attention_heads=2, decoder_attention_heads=2,
                              share_all_embeddings=True)
    base_architecture(args)
    return TransformerModel.build_model(args, SimpleNamespace(source_dictionary=dictionary,
                                                             target_dictionary=dictionary))


def result(label, seconds):
    decoder, beam, batch_size = label.split("/")
    config = BenchConfig(decoder, int(beam[1:]), int(batch_size[2:]), None)
    if seconds is None:
        return ConfigResult(config, skipped="CTranslate2 declines these options")
    return ConfigResult(config, outputs={i: [4, 2] for i in range(SENTENCES)}, seconds=seconds)


def write_run(output_dir: Path, shape, timings, with_model=True) -> dict:
    """output_dir/results.json of a run on a model of this shape; returns its model's shape."""
    models = [tiny_transformer(*shape)]
    options = SimpleNamespace(khead_path=None, cluster_projection=None, repeat=3, reference=None, threads=1)
    cfg = SimpleNamespace(task=SimpleNamespace(data="data-bin"), common_eval=SimpleNamespace(path="model.pt"),
                          dataset=SimpleNamespace(gen_subset="test"))
    inputs = SimpleNamespace(models=models, sentence_ids=list(range(SENTENCES)), use_cuda=False)
    info = bench.run_info(options, cfg, inputs, [], ["data-bin", "--path", "model.pt"])
    if not with_model:
        del info["model"]  # a results.json written before runs recorded the model
    output_dir.mkdir(parents=True)
    report.write_json(output_dir / "results.json", [result(label, s) for label, s in timings.items()], info, {})
    return dict(parameters=sum(p.numel() for p in models[0].parameters()), encoder_layers=shape[0],
                decoder_layers=shape[1], width=shape[2])


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """size -> (its results directory, its model's shape); big's results.json has no model."""
    root = tmp_path_factory.mktemp("sizes")
    return {name: (root / name, write_run(root / name, shape, timings, with_model=name != "big"))
            for name, (shape, timings) in SIZES.items()}


def table_rows(stdout):
    rows = [line.strip("|").split("|") for line in stdout.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows}


def image_width(path):
    from matplotlib import image

    return image.imread(path).shape[1]  # (height, width, channels)


def test_run_info_records_the_models_parameters_layers_and_width(sizes):
    directory, shape = sizes["toy"]
    assert json.loads((directory / "results.json").read_text())["model"] == shape


def test_the_plot_and_the_table_of_three_sizes_beside_ctranslate2(sizes, tmp_path):
    plot = tmp_path / "plots" / "sizes.png"
    given = [f"toy={sizes['toy'][0]}", f"base={sizes['base'][0] / 'results.json'}", f"big={sizes['big'][0]}"]
    completed = subprocess.run(bench_command() + ["--plot-sizes", str(plot), *given], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert plot.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    rows = table_rows(completed.stdout)
    toy_parameters = size_plot.count(sizes["toy"][1]["parameters"])
    assert rows["configuration"] == [f"toy (2+1, 16, {toy_parameters})",
                                     f"base (3+3, 32, {size_plot.count(sizes['base'][1]['parameters'])})", "big"]
    # sentences/s (median), and the speed over CTranslate2's at the same beam and batching where it was measured
    assert rows["greedy/b1/bs8"] == ["20.0 (0.50x)", "10.0 (0.50x)", "2.5"]
    assert rows["beam/b5/bs8"] == ["10.0 (2.00x)", "5.0", "2.0"]
    assert rows["ctranslate2/b1/bs8"] == ["40.0", "20.0", ""]
    assert rows["ctranslate2/b5/bs8"] == ["5.0", "skipped", ""]
    assert f"Plot: {plot}" in completed.stdout
    assert "DEBUG" not in completed.stderr  # matplotlib's debug lines (fairseq's import sets the root logger to DEBUG)


def test_without_ctranslate2_the_plot_has_one_panel_and_the_table_no_ratios(sizes, tmp_path):
    with_peer, alone = tmp_path / "with.png", tmp_path / "alone.png"
    size_plot.plot_sizes(str(with_peer), [f"toy={sizes['toy'][0]}", f"big={sizes['big'][0]}"])
    base_alone = tmp_path / "base-alone"
    shape, timings = SIZES["base"]
    write_run(base_alone, shape, {label: s for label, s in timings.items() if not label.startswith("ctranslate2")})
    table = size_plot.plot_sizes(str(alone), [f"base={base_alone}", f"big={sizes['big'][0]}"])
    rows = table_rows(table)
    assert rows["greedy/b1/bs8"] == ["10.0", "2.5"] and rows["beam/b5/bs8"] == ["5.0", "2.0"]
    assert len(rows) == 3  # the header and the two configurations
    assert alone.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    assert image_width(alone) < image_width(with_peer)  # no panel of speeds over CTranslate2's


def misuses(sizes, tmp_path):
    """name -> (arguments after fastgen-bench, the message of its one error line)."""
    toy, base = str(sizes["toy"][0]), str(sizes["base"][0])
    text_file = tmp_path / "results.md"
    text_file.write_text("| configuration | sentences/s |\n")
    out = str(tmp_path / "sizes.png")
    return {
        "one size": (["--plot-sizes", out, f"toy={toy}"], "--plot-sizes needs at least 2 sizes"),
        "missing file": (["--plot-sizes", out, f"toy={toy}", "base=/nonexistent/results.json"],
                         "/nonexistent/results.json does not exist"),
        "not JSON": (["--plot-sizes", out, f"toy={toy}", f"base={text_file}"], "not a fastgen-bench results.json"),
        "no NAME=": (["--plot-sizes", out, f"toy={toy}", base], "expected NAME=RESULTS"),
        "no PNG file": (["--plot-sizes", f"toy={toy}", f"base={base}"], "the first argument is the PNG file"),
        "a bench option": (["--plot-sizes", out, f"toy={toy}", f"base={base}", "--decoders", "greedy"],
                           "takes no other argument; got --decoders"),
    }


def test_each_misuse_ends_with_one_error_line_and_exit_2(sizes, tmp_path, capsys):
    cases = misuses(sizes, tmp_path)
    argv, message = cases.pop("one size")  # the console script itself, once: the others in this process
    assert_one_error_line(subprocess.run(bench_command() + argv, capture_output=True, text=True), "fastgen-bench",
                          message)
    for name, (argv, message) in cases.items():
        with pytest.raises(SystemExit) as exit_status:
            bench_main(argv)
        stderr = capsys.readouterr().err
        completed = subprocess.CompletedProcess(argv, exit_status.value.code, "", stderr)
        assert_one_error_line(completed, "fastgen-bench", message)
    assert not (tmp_path / "sizes.png").exists()


@pytest.mark.parametrize("argv_head, spec_json, message", [
    (["data-bin"], None, "takes no other argument; got data-bin"),
    ([], {"tool": "fastgen-distill", "configurations": []}, "its 'tool' is not fastgen-bench"),
    ([], {"tool": "fastgen-bench", "configurations": [{"label": "greedy/b1/bs8"}]}, "KeyError: 'status'"),
])
def test_more_misuses_in_process(sizes, tmp_path, capsys, argv_head, spec_json, message):
    """The same refusals as above, in this process (bench.main is what the console script runs)."""
    base = sizes["base"][0]
    if spec_json is not None:
        base = tmp_path / "other.json"
        base.write_text(json.dumps(spec_json))
    with pytest.raises(SystemExit) as exit_status:
        bench.main(argv_head + ["--plot-sizes", str(tmp_path / "s.png"), f"toy={sizes['toy'][0]}", f"base={base}"])
    assert exit_status.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("fastgen-bench: error: ") and message in errors[0]


def test_help_lists_the_option():
    assert "--plot-sizes OUT.png [NAME=RESULTS ...]" in bench.options.bench_parser().format_help()
