"""fastgen-bench with cluster files given as variants: every other
configuration times its full projection in a pass of its own (its timed passes
run without the timer), and each projected one reports its projection speedup
against its reference."""

import json

import pytest

from fairseq_fastgen import bench
from fairseq_fastgen.bench import options
from fairseq_fastgen.bench.inputs import BenchInputs

pytestmark = pytest.mark.xdist_group("test_cluster_bench")

SENTENCES = 12


def bench_argv(toy_model, tmp_path, *variants):
    argv = [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu", "--threads", "1",
        "--decoders", "beam,greedy", "--beam", "2", "--batch-size", "6", "--repeat", "1",
        "--max-sentences", str(SENTENCES), "--output-dir", str(tmp_path), "--no-ctranslate2", "--no-progress-bar",
        "--reference", "self",
    ]
    return argv + [arg for name, path in variants for arg in ("--variant", f"{name}=--cluster-projection {path}")]


def test_variants_with_cluster_files_report_the_projection_speedup(toy_model, full_coverage_path, trained_cluster_path,
                                                                   tmp_path, capsys):
    argv = bench_argv(toy_model, tmp_path, ("whole", full_coverage_path), ("trained", trained_cluster_path))
    results = {r.config.label: r for r in bench.main(argv)}
    assert sorted(results) == sorted(f"{d}{suffix}" for d in ("beam/b2/bs6", "greedy/b1/bs6")
                                     for suffix in ("", "/whole", "/trained"))
    for plain_label in ("beam/b2/bs6", "greedy/b1/bs6"):
        plain, whole, trained = (results[plain_label + suffix] for suffix in ("", "/whole", "/trained"))
        assert plain.ok and whole.ok and trained.ok
        # the full projection is timed, whole-vocabulary steps only, and decodes as without timing
        assert plain.statistics["projection_steps"] > 0
        assert plain.statistics["projection_full_vocab_steps"] == plain.statistics["projection_steps"]
        assert "projection_speedup" not in plain.statistics
        # a whole-vocabulary file changes no output; a trained one projects onto part of the vocabulary
        assert whole.reference == plain_label and whole.identical_rate == 1.0
        assert trained.statistics["projection_active_fraction_mean"] < 1.0
        for projected in (whole, trained):
            expected = plain.statistics["projection_ms_per_step"] / projected.statistics["projection_ms_per_step"]
            assert projected.statistics["projection_speedup"] == pytest.approx(expected)
    written = {c["label"]: c for c in json.loads((tmp_path / "results.json").read_text())["configurations"]}
    assert written["greedy/b1/bs6/trained"]["statistics"]["projection_speedup"] == pytest.approx(
        results["greedy/b1/bs6/trained"].statistics["projection_speedup"])
    # the projection table: one row per projected configuration, its ratios against its reference
    printed = capsys.readouterr().out
    table = printed[printed.index("Vocabulary projection against the reference configuration"):]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert sorted(label for label in rows if label != "configuration") == sorted(
        f"{d}/{v}" for d in ("beam/b2/bs6", "greedy/b1/bs6") for v in ("whole", "trained"))
    whole = rows["beam/b2/bs6/whole"]
    assert whole[1] == "beam/b2/bs6" and whole[2].startswith("100.0% (100.0%)") and whole[6] == "100.0%"
    assert whole[7].strip(" |") == "+0.00"
    trained = results["greedy/b1/bs6/trained"]
    assert rows["greedy/b1/bs6/trained"][4] == f"{trained.statistics['projection_speedup']:.2f}x"


def test_the_configurations_without_a_file_run_as_a_user_runs_them_and_time_their_projection_apart(
        toy_model, trained_cluster_path, tmp_path):
    """The baseline's timed passes must not pay for the timer (which takes the projection out of a compiled
    engine's units): its own generator projects as the decoder does, the timer's config adds --time-projection."""
    run_bench, cfg = options.parse_command_line(bench_argv(toy_model, tmp_path, ("trained", trained_cluster_path)))
    inputs = BenchInputs(cfg, run_bench.khead_path, run_bench.max_sentences)
    for config in options.configurations(run_bench, with_ctranslate2=False):
        prepared = bench.prepare_candidate(config, run_bench, inputs, None)
        generator = prepared.candidate.generator
        projection = getattr(getattr(generator, "runner", None), "projection", None) or getattr(
            generator, "projection", None)
        if config.variant == "trained":
            assert prepared.timer_cfg is None and projection is not None
        else:
            assert projection is None and not prepared.run_cfg.generation.time_projection
            assert prepared.timer_cfg.generation.time_projection is True
