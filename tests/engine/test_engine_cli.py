"""--step-engine through fairseq-interactive: every line answered once, in order, with the compiled engine
as with fairseq's step (an empty line and one longer than the model reads included)."""

import pytest

from tests.test_foundation_cli import hypotheses, interactive


@pytest.mark.parametrize("decoder, beam", [("greedy", 1), ("var-stream", 4)])
def test_interactive_with_the_compiled_engine_answers_every_line_in_order(toy_model, decoder, beam):
    test_lines = (toy_model.raw / "test.en").read_text().splitlines()[:6]
    too_long = " ".join(test_lines[0].split() * 200)  # far beyond the toy's 64 source positions
    lines = test_lines[:2] + ["", too_long] + test_lines[2:]
    options = ["--decoder", decoder, "--beam", str(beam), "--buffer-size", "3", "--batch-size", "2"]
    compiled = interactive(toy_model, lines, *options, "--step-engine", "compiled")
    stock_step = interactive(toy_model, lines, *options, "--step-engine", "fairseq")
    assert compiled.returncode == stock_step.returncode == 1, compiled.stderr[-2000:]
    assert "sentence 3 has" in compiled.stderr and "sentence ids 3);" in compiled.stderr
    order = [int(line.split("\t")[0][2:]) for line in compiled.stdout.splitlines() if line.startswith("H-")]
    assert order == [0, 1, 2, 4, 5, 6, 7]  # the empty line (2) answered too, the long one (3) refused alone
    got = {sid: text for sid, (text, _) in hypotheses(compiled.stdout).items()}
    assert got == {sid: text for sid, (text, _) in hypotheses(stock_step.stdout).items()}
