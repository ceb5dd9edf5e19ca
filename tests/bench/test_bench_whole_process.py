"""Fastgen-bench --whole-process times real fairseq-generate processes, stock fairseq beside the plugin."""

import json
import shlex

import pytest

from fairseq_fastgen import bench
from fairseq_fastgen.bench import options
from fairseq_fastgen.bench.options import BenchConfig
from fairseq_fastgen.bench.whole_process import generate_command, parse_output, without_option
from fastgen_demo import toy

pytestmark = pytest.mark.xdist_group("test_bench_whole_process")


def parsed(argv):
    bench_options, _ = options.parse_command_line(argv)
    return bench_options


def toy_args(toy_model, output_dir, *extra):
    return [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1",
            "--beam", "2", "--batch-size", "8", "--repeat", "1", "--no-progress-bar", "--no-ctranslate2",
            "--output-dir", str(output_dir), *extra]


def test_generate_commands_carry_the_configuration_and_stock_runs_without_the_plugin(toy_model):
    argv = [str(toy_model.data_bin), "--path", "base.pt", "--cpu", "--user-dir", toy.PLUGIN_DIR, "--decoders", "beam",
            "--whole-process", "--khead-path", "khead.pt", "--variant", "copies=--no-shared-encoder-cache --lenpen 2"]
    args = parsed(argv)
    plugin = generate_command(BenchConfig("blockwise", 1, 64, None, variant="copies"), args, "stats.json")
    assert plugin[-4:] == ["--lenpen", "2", "--path", "khead.pt"]
    assert shlex.join(plugin).count("--user-dir") == 1 and toy.PLUGIN_DIR in plugin
    for name, value in [("--decoder", "blockwise"), ("--beam", "1"), ("--batch-size", "64"),
                        ("--gen-subset", "test"), ("--decoder-stats-json", "stats.json")]:
        assert plugin[plugin.index(name) + 1] == value
    assert "--no-shared-encoder-cache" in plugin and "--time-projection" not in plugin
    timer = generate_command(BenchConfig("beam", 5, 64, None), args, "timer.json", time_projection=True)
    assert timer[-1] == "--time-projection" and timer[timer.index("--decoder-stats-json") + 1] == "timer.json"
    stock = generate_command(BenchConfig(options.STOCK_PROCESS, 4, None, 900), args, None)
    assert stock[: len(toy.stock_fairseq_command("generate"))] == toy.stock_fairseq_command("generate")
    assert "--user-dir" not in stock and "--decoder" not in stock and "khead.pt" not in stock
    assert stock[stock.index("--max-tokens") + 1] == "900" and stock[stock.index("--beam") + 1] == "4"


def test_whole_process_runs_add_stock_fairseq_once_per_beam_and_batching(toy_model):
    args = parsed([str(toy_model.data_bin), "--path", "m.pt", "--decoders", "beam,greedy", "--beam", "1,4",
                   "--batch-size", "8", "--whole-process", "--variant", "v=--lenpen 2"])
    labels = [c.label for c in options.configurations(args, with_ctranslate2=False)]
    assert labels == ["beam/b1/bs8", "beam/b1/bs8/v", "greedy/b1/bs8", "greedy/b1/bs8/v", "fairseq/b1/bs8",
                      "beam/b4/bs8", "beam/b4/bs8/v", "fairseq/b4/bs8"]


def test_max_sentences_is_refused_in_whole_process_runs(toy_model, capsys):
    with pytest.raises(SystemExit):
        parsed([str(toy_model.data_bin), "--path", "m.pt", "--whole-process", "--max-sentences", "10"])
    assert "--max-sentences: a --whole-process run decodes the whole --subset" in capsys.readouterr().err


def test_output_parsing_keeps_each_sentence_best_hypothesis_and_the_token_count():
    stdout = "\n".join([
        "S-3\ta b", "H-3\t-0.5\tx y", "D-3\t-0.5\tx y", "P-3\t-0.1 -0.4",
        "D-3\t-0.9\tsecond best", "D-0\t-1.2\t", "2026 | INFO | fairseq_cli.generate | Translated 2 sentences "
        "(1,234 tokens) in 0.1s (20.00 sentences/s, 12340.00 tokens/s)",
    ])
    assert parse_output(stdout) == ({3: "x y", 0: ""}, 1234)
    summary = stdout.splitlines()[-1]
    assert parse_output(stdout.replace(summary, ""), summary) == ({3: "x y", 0: ""}, 1234)
    with pytest.raises(ValueError, match="no 'Translated N sentences"):
        parse_output("D-1\t-0.1\tx")
    assert without_option(["a", "--user-dir", "d", "--user-dir=e", "b"], "--user-dir") == ["a", "b"]


def test_whole_process_outputs_are_the_in_process_outputs_as_fairseq_generate_prints_them(toy_model, tmp_path):
    in_process = {r.config.label: r for r in bench.main(toy_args(toy_model, tmp_path / "in", "--decoders", "beam"))}
    results = bench.main(toy_args(toy_model, tmp_path / "whole", "--decoders", "beam,greedy", "--whole-process"))
    outcome = {r.config.label: r for r in results}
    assert list(outcome) == ["beam/b2/bs8", "greedy/b1/bs8", "fairseq/b2/bs8"]
    assert all(r.ok for r in results), [r.skipped for r in results]

    expected = in_process["beam/b2/bs8"]
    detokenized = (tmp_path / "in" / "hypotheses" / "beam_b2_bs8.txt").read_text().splitlines()
    printed = outcome["beam/b2/bs8"]
    assert len(printed.outputs) == len(detokenized) == 200
    assert printed.outputs == {int(i): text for i, text in (line.split("\t") for line in detokenized)}
    assert printed.tokens == expected.tokens and printed.bleu == pytest.approx(expected.bleu)
    # stock fairseq-generate, without the plugin, prints the same hypotheses at this beam (no n-gram banning)
    assert outcome["fairseq/b2/bs8"].identical_rate == 1.0
    assert outcome["fairseq/b2/bs8"].reference == "beam/b2/bs8"

    greedy = outcome["greedy/b1/bs8"]
    assert greedy.statistics["iterations"] > 0 and greedy.statistics["cpu_seconds"] > 0
    assert greedy.memory["cpu_peak_scope"] == "process" and greedy.memory["cpu_peak_rss_mib"] > 50
    assert "cpu_rss_growth_mib" not in greedy.memory  # a process grows from nothing: only its peak is shown
    assert len(greedy.seconds) == 1 and "cpu_seconds" in outcome["fairseq/b2/bs8"].statistics
    written = {c["label"]: c for c in json.loads((tmp_path / "whole" / "results.json").read_text())["configurations"]}
    assert "--decoder greedy" in written["greedy/b1/bs8"]["command"]
    assert "--user-dir" not in written["fairseq/b2/bs8"]["command"]


def twenty_sentence_data_bin(toy_model, directory):
    """The toy's first 20 test sentences, binarized with its dictionaries: at --batch-size 16 stock
    fairseq-generate drops the last batch of 4 (not a multiple of --required-batch-size-multiple 8)."""
    raw = directory / "raw"
    raw.mkdir()
    for lang in (toy.SRC, toy.TGT):
        lines = (toy_model.raw / f"test.{lang}").read_text().splitlines()[:20]
        (raw / f"test.{lang}").write_text("".join(line + "\n" for line in lines))
    toy.run(toy.fairseq_command("preprocess") + [
        "--source-lang", toy.SRC, "--target-lang", toy.TGT, "--testpref", str(raw / "test"),
        "--srcdict", str(toy_model.data_bin / f"dict.{toy.SRC}.txt"),
        "--tgtdict", str(toy_model.data_bin / f"dict.{toy.TGT}.txt"), "--destdir", str(directory / "bin"),
        "--workers", "1",
    ])
    return directory / "bin"


def test_rows_over_different_sentences_are_compared_over_the_common_ones_and_marked(toy_model, tmp_path):
    """Stock's BLEU, speed and "100.0% identical" were over 16 sentences beside rows over 20,
    and only results.json said so."""
    data_bin = twenty_sentence_data_bin(toy_model, tmp_path)
    argv = [str(data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1", "--beam", "2",
            "--batch-size", "16", "--repeat", "1", "--no-progress-bar", "--no-ctranslate2", "--decoders", "beam",
            "--whole-process", "--output-dir", str(tmp_path / "out")]
    results = {r.config.label: r for r in bench.main(argv)}
    plugin, stock = results["beam/b2/bs16"], results["fairseq/b2/bs16"]
    assert (len(plugin.outputs), len(stock.outputs)) == (20, 16)
    assert all(stock.outputs[i] == plugin.outputs[i] for i in stock.outputs)  # the same search
    # over the same sentences, the same hypotheses score the same BLEU and are all identical
    assert stock.bleu == plugin.bleu and stock.identical_rate == 1.0
    assert stock.compared_sentences == plugin.compared_sentences == 16
    assert plugin.own_bleu is not None and stock.own_bleu == stock.bleu  # plugin.own_bleu: over its 20

    table = (tmp_path / "out" / "results.md").read_text()
    stock_row = next(line for line in table.splitlines() if line.startswith("| fairseq/b2/bs16"))
    plugin_row = next(line for line in table.splitlines() if line.startswith("| beam/b2/bs16"))
    assert "fairseq/b2/bs16 (only 16 of 20 sentences)" in stock_row and "100.0%† beam/b2/bs16" in stock_row
    assert f"{plugin.bleu:.2f}†" in plugin_row and "only" not in plugin_row
    assert "over the 16 of 20 sentences that every one translated" in table
    written = {c["label"]: c for c in json.loads((tmp_path / "out" / "results.json").read_text())["configurations"]}
    assert written["fairseq/b2/bs16"]["sentences"] == 16 and written["beam/b2/bs16"]["compared_sentences"] == 16
