"""Which configurations fastgen-bench measures, which it compares, and the Pareto frontier of its plot."""

import math
from types import SimpleNamespace

import pytest

from fairseq_fastgen.bench import options
from fairseq_fastgen.bench.measure import Candidate, ConfigResult, WarmRun, time_interleaved
from fairseq_fastgen.bench.options import BenchConfig
from fairseq_fastgen.bench.report import pareto_frontier
from fairseq_fastgen.bench.scoring import identical_rate, pick_reference, projection_speedup
from fairseq_fastgen.registry import DECODERS, register_builder


def bench_args(**given):
    return options.bench_parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in given.items()])


def test_every_decoder_beam_and_batching_once_and_greedy_only_at_beam_1():
    configs = options.configurations(bench_args(decoders="beam,greedy", beam="1,5", batch_size="1,64"), False)
    assert [c.label for c in configs] == [
        "beam/b1/bs1", "greedy/b1/bs1", "beam/b5/bs1",
        "beam/b1/bs64", "greedy/b1/bs64", "beam/b5/bs64",
    ]


def test_ctranslate2_and_the_cluster_projection_add_configurations():
    configs = options.configurations(
        bench_args(decoders="beam", beam="4", max_tokens="500,900", cluster_projection="clusters.pt"), True
    )
    assert [c.label for c in configs] == [
        "beam/b4/mt500", "beam/b4/mt500/cp", "ctranslate2/b4/mt500",
        "beam/b4/mt900", "beam/b4/mt900/cp", "ctranslate2/b4/mt900",
    ]


def test_variants_multiply_the_plugin_configurations_but_not_ctranslate2():
    args = bench_args(decoders="greedy", batch_size="8")
    args.variants = {"short": object(), "long": object()}
    configs = options.configurations(args, True)
    assert [c.label for c in configs] == [
        "greedy/b1/bs8", "greedy/b1/bs8/short", "greedy/b1/bs8/long", "ctranslate2/b1/bs8", "ctranslate2/b5/bs8",
    ]


def test_fairseq_batching_default_and_pairs_of_limits():
    assert options.batchings(bench_args()) == [(None, options.FAIRSEQ_DEFAULT_MAX_TOKENS)]
    assert options.batchings(bench_args(batch_size="8,16", max_tokens="100")) == [(8, 100), (16, 100)]


def measured(label_parts, outputs):
    decoder, beam, batch_size = label_parts
    return ConfigResult(BenchConfig(decoder, beam, batch_size, None), outputs=outputs)


def test_reference_is_stock_beam_at_the_same_beam_and_batching():
    results = [
        measured(("beam", 1, 8), {0: [4, 2], 1: [5, 2]}),
        measured(("beam", 5, 8), {0: [4, 2], 1: [6, 2]}),
        measured(("beam", 1, 64), {0: [4, 2], 1: [5, 2]}),
        measured(("greedy", 1, 64), {0: [4, 2], 1: [7, 2]}),
        measured(("var-batch", 5, 64), {0: [4, 2], 1: [6, 2]}),
    ]
    assert pick_reference(results[3], results, None) is results[2]
    assert pick_reference(results[4], results, None) is results[1]  # same beam beats same batching
    assert pick_reference(results[4], results, "greedy") is results[3]
    assert pick_reference(results[4], results, "beam/b1/bs8") is results[0]
    assert pick_reference(results[4], results, "no-such") is None
    assert identical_rate(results[3], results[2]) == 0.5
    assert identical_rate(results[4], results[1]) == 1.0


def test_reference_self_is_the_same_decoder_without_projection_or_variant():
    def config(decoder, projected=False, variant=None):
        return ConfigResult(BenchConfig(decoder, 5, 64, None, projected, variant), outputs={0: [4, 2]})

    results = [config("beam"), config("var-batch"), config("var-batch", projected=True),
               config("var-batch", variant="delta3"), config("var-batch", projected=True, variant="delta3")]
    for result in results[1:]:
        assert pick_reference(result, results, "self") is results[1]
    assert pick_reference(results[0], results, "self") is results[0]
    assert pick_reference(results[2], results, None) is results[0]


def test_reference_without_stock_beam_is_the_first_configuration():
    results = [measured(("greedy", 1, 8), {0: [4, 2]}), measured(("var-batch", 5, 8), {0: [4, 2]})]
    assert pick_reference(results[1], results, None) is results[0]


def test_pareto_frontier_keeps_points_no_other_point_beats_on_speed_and_bleu():
    points = [(10.0, 20.0), (5.0, 25.0), (8.0, 19.0), (1.0, 24.0), (12.0, 15.0), (5.0, 22.0)]
    assert sorted(pareto_frontier(points)) == [0, 1, 4]


def shared_config(step_engine="static"):
    return SimpleNamespace(
        common=SimpleNamespace(cpu=True),
        dataset=SimpleNamespace(batch_size=None, max_tokens=None),
        generation=SimpleNamespace(beam=5, decoder="beam", cluster_projection=None, step_engine=step_engine),
    )


def test_run_config_sets_the_configuration_without_touching_the_shared_one():
    cfg = shared_config()
    run_cfg = options.run_config(cfg, BenchConfig("greedy", 1, 16, None, cluster_projection=True), "c.pt")
    assert (run_cfg.dataset.batch_size, run_cfg.dataset.max_tokens) == (16, None)
    assert (run_cfg.generation.beam, run_cfg.generation.decoder, run_cfg.generation.cluster_projection) == (
        1, "greedy", "c.pt")
    assert (cfg.generation.beam, cfg.generation.decoder, cfg.dataset.batch_size) == (5, "beam", None)


def test_the_configuration_without_the_common_cluster_file_drops_its_cluster_nearest():
    """fastgen-bench --cluster-projection FILE --cluster-nearest 2: the configuration beside it without the file
    decodes without --cluster-nearest (refused without a file), the one with it keeps it."""
    cfg = shared_config()
    cfg.generation.cluster_nearest = 2
    plain = options.run_config(cfg, BenchConfig("greedy", 1, 16, None), "c.pt")
    projected = options.run_config(cfg, BenchConfig("greedy", 1, 16, None, cluster_projection=True), "c.pt")
    assert (plain.generation.cluster_projection, plain.generation.cluster_nearest) == (None, 1)
    assert (projected.generation.cluster_projection, projected.generation.cluster_nearest) == ("c.pt", 2)
    assert cfg.generation.cluster_nearest == 2


def test_a_variant_brings_its_own_generation_options():
    cfg = shared_config()
    variant_generation = SimpleNamespace(beam=5, decoder="beam", cluster_projection="c16.pt", max_len_b=3,
                                         step_engine="static")
    run_cfg = options.run_config(cfg, BenchConfig("greedy", 1, 16, None, variant="c16"), None,
                                 {"c16": variant_generation})
    assert (run_cfg.generation.beam, run_cfg.generation.max_len_b, run_cfg.generation.cluster_projection) == (
        1, 3, "c16.pt")
    assert variant_generation.beam == 5 and cfg.generation.cluster_projection is None


def test_the_default_engine_is_measured_with_its_units_compiled_in_the_warm_up(monkeypatch):
    """--step-engine auto on the CPU compiles its units in the background: the bench names the engine it runs once
    they are on disk (compiled, frozen row buckets) and compiles them in the foreground, so that no timed pass
    switches from eager steps to compiled ones halfway."""
    monkeypatch.delenv("FASTGEN_STEP_ENGINE", raising=False)
    cfg = shared_config("auto")
    cfg.generation.quantize, cfg.generation.compiled_freezing, cfg.generation.compile_in_background = None, False, False
    run_cfg = options.run_config(cfg, BenchConfig("greedy", 1, 16, None), None)
    generation = run_cfg.generation
    assert (generation.step_engine, generation.compiled_freezing, generation.compile_in_background) == (
        "compiled", True, False)
    assert cfg.generation.step_engine == "auto"
    monkeypatch.setenv("FASTGEN_STEP_ENGINE", "static")  # auto as the environment names it: left to resolve
    assert options.run_config(cfg, BenchConfig("greedy", 1, 16, None), None).generation.step_engine == "auto"
    cfg.generation.step_engine = "static"
    monkeypatch.delenv("FASTGEN_STEP_ENGINE")
    assert options.run_config(cfg, BenchConfig("greedy", 1, 16, None), None).generation.step_engine == "static"


def test_run_config_lets_the_decoder_prepare_the_run_as_fairseq_generate_does():
    def read_pools(cfg, tool):  # like the streaming decoders: the batch size becomes the capacity
        assert tool == "generate"
        cfg.generation.capacity, cfg.dataset.batch_size = cfg.dataset.batch_size, 1024

    register_builder("bench-test-pools", None, prepare_cli=read_pools)
    try:
        run_cfg = options.run_config(shared_config(), BenchConfig("bench-test-pools", 5, 16, None), None)
    finally:
        del DECODERS["bench-test-pools"]
    assert (run_cfg.generation.capacity, run_cfg.dataset.batch_size) == (16, 1024)


def test_runs_with_a_cluster_file_time_the_full_projection_of_the_others():
    no_files = bench_args(decoders="beam")
    assert not options.projects_on_clusters(no_files)
    with_variant = bench_args(decoders="beam")
    with_variant.variants = {"short": SimpleNamespace(cluster_projection=None),
                             "c16": SimpleNamespace(cluster_projection="c16.pt")}
    assert options.projects_on_clusters(with_variant)
    assert options.projects_on_clusters(bench_args(decoders="beam", cluster_projection="c.pt"))

    cfg = shared_config()
    full = options.run_config(cfg, BenchConfig("beam", 5, 16, None), "c.pt", time_projection=True)
    projected = options.run_config(cfg, BenchConfig("beam", 5, 16, None, cluster_projection=True), "c.pt",
                                   time_projection=True)
    assert full.generation.time_projection is True and full.generation.cluster_projection is None
    assert not getattr(projected.generation, "time_projection", False)
    untimed = options.run_config(cfg, BenchConfig("beam", 5, 16, None), "c.pt")
    assert not getattr(untimed.generation, "time_projection", False)


def test_projection_speedup_is_the_reference_step_time_over_the_configurations():
    full, reduced, untimed = (measured(("beam", 5, 64), {}) for _ in range(3))
    full.statistics = {"projection_ms_per_step": 3.0}
    reduced.statistics = {"projection_ms_per_step": 1.2}
    assert projection_speedup(reduced, full) == pytest.approx(2.5)
    assert projection_speedup(full, reduced) == pytest.approx(0.4)
    assert projection_speedup(reduced, untimed) is None and projection_speedup(untimed, full) is None


def test_timed_passes_take_turns_so_no_configuration_always_runs_last():
    order = []

    class Recorder(Candidate):
        def __init__(self, name):
            self.name = name

        def decode(self, batches):
            order.append((self.name, batches))

    runs = [WarmRun(ConfigResult(BenchConfig(name, 5, 64, None)), Recorder(name), [name])
            for name in ("beam", "var-batch", "var-stream")]
    progress = SimpleNamespace(updates=0)
    progress.update = lambda: setattr(progress, "updates", progress.updates + 1)
    time_interleaved(runs, repeat=3, cuda=False, progress=progress)
    assert order == [(name, [name]) for _ in range(3) for name in ("beam", "var-batch", "var-stream")]
    assert [len(run.result.seconds) for run in runs] == [3, 3, 3]
    assert progress.updates == 9


@pytest.mark.parametrize("argv, message", [
    (["--var-beam-delta", "nan"], "fastgen-bench: error: --var-beam-delta must be a number >= 0 or inf, got nan"),
    (["--variant", "b0=--blockwise-block-size 0"],
     "fastgen-bench: error: --variant b0: --blockwise-block-size must be an integer >= 1, got 0"),
    (["--max-sentences", "0"], "fastgen-bench: error: --max-sentences must be at least 1, got 0"),
])
def test_numbers_out_of_range_are_refused_when_parsed(argv, message, capsys):
    """One error line at parse time, not every configuration skipped for a ValueError."""
    with pytest.raises(SystemExit) as exit_info:
        options.parse_command_line(["DATA", "--path", "model.pt", "--decoders", "var-batch", *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message


def test_numbers_in_range_are_parsed():
    bench, cfg = options.parse_command_line(["DATA", "--path", "model.pt", "--decoders", "var-batch",
                                             "--var-beam-delta", "inf", "--variant", "b1=--blockwise-block-size 1"])
    assert cfg.generation.var_beam_delta == math.inf
    assert bench.variants["b1"].blockwise_block_size == 1
