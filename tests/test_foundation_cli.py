"""The plugin through the real fairseq-generate / fairseq-interactive commands."""

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from fastgen_demo import toy

pytestmark = pytest.mark.xdist_group("test_foundation_cli")


def generate(toy_model, *args, plugin=True, env=None):
    program = toy.fairseq_command("generate") if plugin else toy.stock_fairseq_command("generate")
    cmd = program + [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu"]
    if plugin:
        cmd += ["--user-dir", toy.PLUGIN_DIR]
    completed = subprocess.run(cmd + list(args), capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    return completed


def hypotheses(output):
    """{sentence id: (tokens string, positional scores string)} from H- and P- lines."""
    hyps, scores = {}, {}
    for line in output.splitlines():
        if line.startswith("H-"):
            sid, _, text = line.split("\t")
            hyps[int(sid[2:])] = text
        elif line.startswith("P-"):
            sid, values = line.split("\t")
            scores[int(sid[2:])] = values
    return {sid: (hyps[sid], scores.get(sid)) for sid in hyps}


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_greedy_is_token_identical_to_stock_beam_1(toy_model, batch_size):
    common = ["--batch-size", str(batch_size), "--beam", "1"]
    stock = generate(toy_model, *common, "--required-batch-size-multiple", "1", plugin=False)
    greedy = generate(toy_model, *common, "--decoder", "greedy")
    assert stock.returncode == 0, stock.stderr[-2000:]
    assert greedy.returncode == 0, greedy.stderr[-2000:]
    stock_hyps, greedy_hyps = hypotheses(stock.stdout), hypotheses(greedy.stdout)
    assert len(stock_hyps) == 200
    assert sorted(greedy_hyps) == sorted(stock_hyps)
    differing = [sid for sid in stock_hyps if stock_hyps[sid][0] != greedy_hyps[sid][0]]
    assert differing == [], f"greedy differs from stock --beam 1 on sentences {differing[:10]}"
    # the decoder reports its statistics at the end of the run
    assert re.search(r"decoder greedy: .*sentences=200", greedy.stdout)


def test_runs_without_decoder_flag_match_stock(toy_model):
    stock = generate(toy_model, "--beam", "4", "--batch-size", "16", "--required-batch-size-multiple", "1",
                     plugin=False)
    plugin = generate(toy_model, "--beam", "4", "--batch-size", "16")
    assert stock.returncode == 0 and plugin.returncode == 0, (stock.stderr + plugin.stderr)[-2000:]
    assert hypotheses(plugin.stdout) == hypotheses(stock.stdout)


def test_unknown_decoder_is_refused_with_choices(toy_model):
    result = generate(toy_model, "--decoder", "nonsense")
    assert result.returncode != 0
    assert "invalid choice: 'nonsense'" in result.stderr
    assert "greedy" in result.stderr and "beam" in result.stderr


def test_help_lists_decoder_and_its_options(plugin_dir):
    from fairseq_fastgen.config import PluginOptions
    from fairseq_fastgen.sequence_generators import DECODERS

    for tool in ("generate", "interactive"):
        completed = subprocess.run(toy.fairseq_command(tool) + ["--user-dir", plugin_dir, "--help"],
                                   capture_output=True, text=True)
        assert completed.returncode == 0
        help_text = " ".join(completed.stdout.split())
        choices = re.search(r"--decoder \{([^}]*)\}", help_text).group(1).split(",")
        assert sorted(choices) == sorted(DECODERS)
        for options in [PluginOptions] + [entry.options for entry in DECODERS.values()]:
            if options is None:
                continue
            for name in options.__dataclass_fields__:
                if not name.startswith("_"):
                    assert "--" + name.replace("_", "-") in help_text, f"{name} missing from {tool} --help"


def test_decoder_statistics_reach_json(toy_model, tmp_path):
    stats = tmp_path / "stats.json"
    result = generate(toy_model, "--decoder", "greedy", "--beam", "1", "--decoder-stats-json", str(stats))
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    data = json.loads(stats.read_text())
    assert data["decoder"] == "greedy" and data["sentences"] == 200
    assert data["iterations"] == data["model_calls"]


@pytest.mark.parametrize("decoder", ["var-batch", "var-stream"])
def test_sentences_short_of_nbest_are_counted_in_one_warning_line(toy_model, decoder):
    """A variable-width beam can end a sentence with fewer than --nbest hypotheses (stock beam
    search fills each n-best); that was silent."""
    result = generate(toy_model, "--decoder", decoder, "--beam", "5", "--nbest", "3", "--batch-size", "64")
    assert result.returncode == 0, result.stderr[-2000:]
    sources = [int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line.startswith("S-")]
    assert sorted(sources) == list(range(200))  # every sentence answered once
    hypothesis_lines = [line for line in result.stdout.splitlines() if line.startswith("H-")]
    per_sentence = Counter(int(line.split("\t")[0][2:]) for line in hypothesis_lines)
    assert set(per_sentence) == set(sources) and max(per_sentence.values()) <= 3
    short = sum(1 for count in per_sentence.values() if count < 3)
    assert short > 0
    warnings = [line for line in result.stderr.splitlines() if "--nbest" in line]
    assert len(warnings) == 1, warnings
    assert (f"--decoder {decoder}: {short} of 200 sentences got fewer than --nbest 3 hypotheses (a variable-width "
            f"beam can end with fewer candidates; stock beam search, --decoder beam, fills every n-best)") in warnings[0]


def binarize_test_subset(toy_model, out_dir, n):
    """A data-bin whose test split holds the first n toy test sentences (same dictionaries)."""
    raw = Path(out_dir) / "raw"
    raw.mkdir(parents=True)
    for lang in (toy.SRC, toy.TGT):
        lines = (toy_model.raw / f"test.{lang}").read_text().splitlines()[:n]
        (raw / f"test.{lang}").write_text("\n".join(lines) + "\n")
    bin_dir = Path(out_dir) / "bin"
    toy.run(toy.fairseq_command("preprocess") + [
        "--source-lang", toy.SRC, "--target-lang", toy.TGT, "--testpref", str(raw / "test"),
        "--srcdict", str(toy_model.data_bin / f"dict.{toy.SRC}.txt"),
        "--tgtdict", str(toy_model.data_bin / f"dict.{toy.TGT}.txt"), "--destdir", str(bin_dir), "--workers", "1",
    ])
    return bin_dir


def test_default_batching_keeps_every_sentence(toy_model, tmp_path):
    bin_dir = binarize_test_subset(toy_model, tmp_path, 100)
    cmd = toy.fairseq_command("generate") + [str(bin_dir), "--path", str(toy_model.checkpoint), "--cpu",
                                             "--user-dir", toy.PLUGIN_DIR, "--beam", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    ids = sorted(hypotheses(result.stdout))
    assert ids == list(range(100))


def interactive(toy_model, lines, *args):
    cmd = toy.fairseq_command("interactive") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--user-dir", toy.PLUGIN_DIR,
        "--source-lang", toy.SRC, "--target-lang", toy.TGT,
    ] + list(args)
    return subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)


def test_interactive_greedy_answers_every_line_in_order(toy_model):
    test_lines = (toy_model.raw / "test.en").read_text().splitlines()[:5]
    lines = [test_lines[0], "", "zzqx qqvv unknownword", test_lines[1], test_lines[2], test_lines[3], test_lines[4]]
    result = interactive(toy_model, lines, "--decoder", "greedy", "--beam", "1", "--buffer-size", "3",
                         "--batch-size", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    hyp_ids = [int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line.startswith("H-")]
    assert hyp_ids == list(range(len(lines)))
    sources = [line.split("\t", 1)[1] for line in result.stdout.splitlines() if line.startswith("S-")]
    assert sources[2] == "<unk> <unk> <unk>"
    assert sources[1] == ""
    # the same sentences through fairseq-generate's greedy give the same hypotheses
    solo = interactive(toy_model, [test_lines[0]], "--beam", "1")
    first = [line for line in result.stdout.splitlines() if line.startswith("H-0")]
    assert first == [line for line in solo.stdout.splitlines() if line.startswith("H-0")]


@pytest.mark.parametrize("decoder, beam", [("greedy", 1), ("var-stream", 4)])
def test_interactive_refuses_an_oversized_line_alone(toy_model, decoder, beam):
    """Stock fairseq-interactive ends with a traceback at a line longer than the model reads, and the other
    lines of its buffer, and every later line, are never translated; the plugin refuses that line alone."""
    test_lines = (toy_model.raw / "test.en").read_text().splitlines()[:5]
    too_long = " ".join(test_lines[0].split() * 200)  # far beyond the toy's 64 source positions
    lines = test_lines[:2] + [too_long] + test_lines[2:]
    options = ["--decoder", decoder, "--beam", str(beam)]
    result = interactive(toy_model, lines, *options, "--buffer-size", "4", "--batch-size", "2")
    assert result.returncode == 1
    assert sorted(hypotheses(result.stdout)) == [0, 1, 3, 4, 5]
    assert re.search(r"sentence 2 has \d+ tokens .* not translated", result.stderr)
    assert "sentence ids 2);" in result.stderr
    # the others are what they are without the long line (one line per batch on both sides: same batches)
    alone = interactive(toy_model, lines, *options)
    without = interactive(toy_model, test_lines, *options)
    assert alone.returncode == 1 and without.returncode == 0, without.stderr[-2000:]
    got = {sid: text for sid, (text, _) in hypotheses(alone.stdout).items()}
    expected = {sid + (sid >= 2): text for sid, (text, _) in hypotheses(without.stdout).items()}
    assert got == expected
    # asked to skip such lines, fairseq's own behaviour: skipped with a warning, exit 0
    skipped = interactive(toy_model, lines, *options, "--skip-invalid-size-inputs-valid-test")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert sorted(hypotheses(skipped.stdout)) == [0, 1, 3, 4, 5]


def test_interactive_names_postprocess_workers_in_one_warning_line(toy_model):
    """--postprocess-workers (fairseq-generate's) was ignored by fairseq-interactive silently."""
    lines = (toy_model.raw / "test.en").read_text().splitlines()[:3]
    result = interactive(toy_model, lines, "--decoder", "greedy", "--beam", "1", "--postprocess-workers", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    answered = [int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line.startswith("H-")]
    assert answered == [0, 1, 2]  # each once, in order
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "--postprocess-workers" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "--postprocess-workers applies to fairseq-generate; fairseq-interactive prints each answer in its own loop: "
        "--postprocess-workers 2 is not used"), warnings


@pytest.mark.parametrize("decoder", ["greedy", "greedy-stream"])
def test_interactive_refuses_a_line_over_max_tokens_alone(toy_model, decoder):
    """A line within the model's positions but longer than --max-tokens ended the run with
    fairseq's AssertionError ("Sentences lengths should not exceed max_tokens"); it is refused alone.  And
    a streamed decoder (its capacity read from --max-tokens) translated it without a word."""
    test_lines = (toy_model.raw / "test.en").read_text().splitlines()[:4]
    over_budget = " ".join(test_lines[0].split() * 3)[:150]  # about 30 tokens: under 64 positions, over 24
    lines = test_lines[:1] + [over_budget] + test_lines[1:]
    options = ["--decoder", decoder, "--beam", "1", "--max-tokens", "24"]
    result = interactive(toy_model, lines, *options, "--buffer-size", "3")
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1
    answered = [int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line.startswith("H-")]
    assert answered == [0, 2, 3, 4]  # each once, in order
    refusals = [line for line in result.stderr.splitlines() if line.startswith("fairseq-interactive: sentence")]
    assert len(refusals) == 1 and re.match(r"fairseq-interactive: sentence 1 has \d+ tokens \(with eos\), more than "
                                           r"--max-tokens 24; not translated", refusals[0])
    assert "sentence ids 1);" in result.stderr
    # fairseq's skip option does not cover --max-tokens; with the plugin it skips that line too
    skipped = interactive(toy_model, lines, *options, "--skip-invalid-size-inputs-valid-test")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert sorted(hypotheses(skipped.stdout)) == [0, 2, 3, 4]
