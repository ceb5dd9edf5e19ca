"""Streaming (streaming.py): var-stream = var-batch and fixed-stream = static fixed-width search,
sentence by sentence, bitwise; capacity and refill rules; fairseq-generate and fairseq-interactive."""

import json
import re
import shutil

import pytest
import torch

from fairseq_fastgen.sequence_generators import generator as generator_module
from fairseq_fastgen.sequence_generators import streaming
from fairseq_fastgen.sequence_generators.streaming import kernels_are_companion_free
from fastgen_demo import toy as toy_pipeline
from test_var_beam import TEST_SENTENCES, assert_identical, toy  # noqa: F401  (toy: the model fixture)

CAPACITY = 8


def translate_in_batches(toy, generator, ids, batch_size):
    results = {}
    for start in range(0, len(ids), batch_size):
        results.update(toy.translate(generator, ids[start : start + batch_size]))
    return results


class AdmissionLog:
    """Records when sources are admitted (encoded) and finished, to check the capacity rules from outside."""

    def __init__(self, monkeypatch):
        self.events = []  # ("admit", [pool indices]) or ("finish", pool index), in order
        encode, finish = streaming.CompanionFreeLayout.encode, generator_module.DecodeContext.finish

        def logged_encode(layout, ctx, sentences):
            self.events.append(("admit", sentences.tolist()))
            return encode(layout, ctx, sentences)

        def logged_finish(ctx, sentence, hypotheses):
            self.events.append(("finish", sentence))
            return finish(ctx, sentence, hypotheses)

        monkeypatch.setattr(streaming.CompanionFreeLayout, "encode", logged_encode)
        monkeypatch.setattr(generator_module.DecodeContext, "finish", logged_finish)

    def loads_at_refills(self, source_len):
        """(active sources, active tokens) before each refill, and the peak load after any admission."""
        active, at_refills, peak = set(), [], (0, 0)
        for number, (kind, what) in enumerate(self.events):
            if kind == "finish":
                active.discard(what)
                continue
            if number:
                at_refills.append((len(active), sum(source_len[s] for s in active)))
            active.update(what)
            peak = max(peak, (len(active), sum(source_len[s] for s in active)))
        return at_refills, peak


@pytest.fixture(scope="module")
def var_batch_results(toy):
    """var-batch on fixed batches of 25 sentences: the reference of every streaming run."""
    return translate_in_batches(toy, toy.generator(decoder="var-batch", beam=5), list(range(TEST_SENTENCES)), 25)


@pytest.mark.parametrize("eps", [1 / 12, 1 / 6, 1 / 2])
def test_var_stream_equals_var_batch_over_many_refills(toy, var_batch_results, eps, monkeypatch):
    log = AdmissionLog(monkeypatch)
    generator = toy.generator(decoder="var-stream", beam=5, stream_capacity=CAPACITY, stream_eps=eps)
    sample = toy.sample(range(TEST_SENTENCES))
    streamed = dict(zip(sample["id"].tolist(), generator.generate(toy.models, sample)))
    assert_identical(var_batch_results, streamed, across_batches=True)

    source_len = sample["net_input"]["src_tokens"].ne(toy.task.source_dictionary.pad()).sum(1).tolist()
    at_refills, (peak_sentences, _) = log.loads_at_refills(source_len)
    assert peak_sentences == CAPACITY
    assert all(sentences <= eps * CAPACITY for sentences, _ in at_refills)
    assert len(at_refills) == generator.counters.counts["refills"] >= TEST_SENTENCES / CAPACITY - 1


def test_var_stream_with_token_capacity(toy, var_batch_results, monkeypatch):
    log = AdmissionLog(monkeypatch)
    capacity_tokens = 150
    generator = toy.generator(decoder="var-stream", beam=5, stream_capacity_tokens=capacity_tokens, stream_eps=1 / 3)
    sample = toy.sample(range(TEST_SENTENCES))
    streamed = dict(zip(sample["id"].tolist(), generator.generate(toy.models, sample)))
    assert_identical(var_batch_results, streamed, across_batches=True)

    source_len = sample["net_input"]["src_tokens"].ne(toy.task.source_dictionary.pad()).sum(1).tolist()
    at_refills, (_, peak_tokens) = log.loads_at_refills(source_len)
    assert capacity_tokens - max(source_len) < peak_tokens <= capacity_tokens
    assert all(tokens <= capacity_tokens / 3 for _, tokens in at_refills) and len(at_refills) >= 10


def test_fixed_stream_equals_fixed_width_search_on_static_batches(toy):
    ids = list(range(0, TEST_SENTENCES, 2))
    static = translate_in_batches(toy, toy.generator(decoder="fixed-stream", beam=4), ids, 20)
    streamed = toy.generator(decoder="fixed-stream", beam=4, stream_capacity=6)
    assert_identical(static, toy.translate(streamed, ids), across_batches=True)
    assert streamed.counters.counts["refills"] >= 10


def test_nbest_and_length_options_stream_identically(toy):
    ids = list(range(0, TEST_SENTENCES, 4))
    options = dict(beam=4, nbest=2, lenpen=0.5, no_repeat_ngram_size=3, max_len_a=1.1, max_len_b=1, var_beam_delta=2.5)
    static = toy.translate(toy.generator(decoder="var-batch", **options), ids)
    streamed = toy.translate(toy.generator(decoder="var-stream", stream_capacity=5, stream_eps=0.2, **options), ids)
    assert_identical(static, streamed, across_batches=True)


# ---- command line ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def edge_case_data(toy_model, tmp_path_factory):
    """A raw-text test set with a 1-token source, sources at the 64 positions limit (63 tokens + eos)
    and ordinary sentences; the toy model's dictionaries."""
    raw_en = (toy_model.raw / "test.en").read_text().split("\n")[:24]
    raw_fr = (toy_model.raw / "test.fr").read_text().split("\n")[:24]
    words = " ".join(raw_en).split()
    longest = " ".join(words[:63])
    sources = [words[0], longest] + raw_en[:10] + [words[5], " ".join(words[10:73])] + raw_en[10:24]
    targets = ["x", "x"] + raw_fr[:10] + ["x", "x"] + raw_fr[10:24]
    data = tmp_path_factory.mktemp("edge_cases")
    for lang in ("en", "fr"):
        shutil.copy(toy_model.data_bin / f"dict.{lang}.txt", data / f"dict.{lang}.txt")
    (data / "test.en-fr.en").write_text("\n".join(sources) + "\n")
    (data / "test.en-fr.fr").write_text("\n".join(targets) + "\n")
    return data, sources


def run_cli(tool, args, monkeypatch, stdin=None):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # fast on shared machines; results are thread-count independent
    cmd = toy_pipeline.fairseq_command(tool) + args
    if stdin is None:
        return toy_pipeline.run(cmd)
    import subprocess

    completed = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def hypothesis_lines(output):
    """{sentence id: [H line, P line]} of every hypothesis printed; each id printed once."""
    lines = {}
    for line in output.splitlines():
        match = re.match(r"([HP])-(\d+)\t", line)
        if match:
            lines.setdefault(int(match.group(2)), []).append(line)
    return lines


SEARCH_OPTIONS = ["--beam", "4", "--nbest", "2"]


def assert_same_printed_hypotheses(expected, actual):
    """H and P lines equal; where this CPU's kernels are not companion-free (streaming.py), the same
    hypotheses with every printed score within one unit of its last printed digit (1e-4) either way."""
    if kernels_are_companion_free(torch.get_num_threads()):
        assert actual == expected
        return
    assert actual.keys() == expected.keys()
    for sentence, lines in expected.items():
        assert len(actual[sentence]) == len(lines), sentence
        for want, got in zip(lines, actual[sentence]):
            want_fields, got_fields = want.split("\t"), got.split("\t")
            assert got_fields[0] == want_fields[0] and got_fields[2:] == want_fields[2:], sentence  # id, text
            numbers = [float(v) for v in got_fields[1].split()], [float(v) for v in want_fields[1].split()]
            assert numbers[0] == pytest.approx(numbers[1], abs=2e-4), sentence


def generate_args(toy_model, plugin_dir, data):
    return [str(data), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
            "--dataset-impl", "raw", "--gen-subset", "test", "--batch-size", "4"] + SEARCH_OPTIONS


@pytest.fixture(scope="module")
def var_batch_cli_lines(toy_model, plugin_dir, edge_case_data):
    """H and P lines of fairseq-generate --decoder var-batch on the edge-case set (batches of 4)."""
    data, _ = edge_case_data
    with pytest.MonkeyPatch.context() as monkeypatch:
        output = run_cli("generate", generate_args(toy_model, plugin_dir, data) + ["--decoder", "var-batch"], monkeypatch)
    return hypothesis_lines(output)


def assert_one_result_per_sentence(lines, count):
    assert sorted(lines) == list(range(count))
    assert all(len(pair) in (2, 4) for pair in lines.values())  # up to nbest 2: an H and a P line each


def test_fairseq_generate_var_stream(toy_model, plugin_dir, edge_case_data, var_batch_cli_lines, tmp_path,
                                     monkeypatch):
    data, sources = edge_case_data
    stats_path = tmp_path / "stats.json"
    options = ["--decoder", "var-stream", "--stream-pool", "16", "--decoder-stats-json", str(stats_path)]
    streamed = run_cli("generate", generate_args(toy_model, plugin_dir, data) + options, monkeypatch)

    assert_one_result_per_sentence(hypothesis_lines(streamed), len(sources))
    assert_same_printed_hypotheses(var_batch_cli_lines, hypothesis_lines(streamed))
    stats = json.loads(stats_path.read_text())
    assert stats["decoder"] == "var-stream" and stats["sentences"] == len(sources)
    assert stats["refills"] >= 4  # two pools of 16 and 12 sentences streamed through 4 at a time
    assert stats["candidate_expansions_per_step"] == pytest.approx(stats["candidate_expansions"] / stats["model_calls"])
    assert re.search(r"decoder var-stream: .*refills=\d+", streamed)


def test_fairseq_interactive_var_stream_answers_every_line_in_order(toy_model, plugin_dir, edge_case_data,
                                                                    var_batch_cli_lines, monkeypatch):
    _, sources = edge_case_data
    args = [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
            "--source-lang", "en", "--target-lang", "fr", "--decoder", "var-stream",
            "--buffer-size", "10", "--batch-size", "3"] + SEARCH_OPTIONS
    streamed = run_cli("interactive", args, monkeypatch, stdin="\n".join(sources) + "\n")

    source_ids = [int(m) for m in re.findall(r"^S-(\d+)\t", streamed, flags=re.M)]
    assert source_ids == list(range(len(sources)))
    assert_one_result_per_sentence(hypothesis_lines(streamed), len(sources))
    assert_same_printed_hypotheses(var_batch_cli_lines, hypothesis_lines(streamed))  # fairseq-generate var-batch
    assert re.search(r"decoder var-stream: .*refills=\d+", streamed)


def test_capacity_comes_from_batch_options(toy):
    """prepare_cli records --batch-size / --max-tokens as the capacity and enlarges the batches to a pool."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "generation": {"stream_capacity": None, "stream_capacity_tokens": None, "stream_pool": 300},
        "dataset": {"batch_size": None, "max_tokens": 2000},
        "interactive": {"buffer_size": 40},
    })
    streaming.prepare_streaming_cli(cfg, "generate")
    assert (cfg.generation.stream_capacity, cfg.generation.stream_capacity_tokens) == (None, 2000)
    assert (cfg.dataset.batch_size, cfg.dataset.max_tokens) == (300, None)
    cfg.dataset.batch_size, cfg.generation.stream_capacity_tokens = 16, None
    streaming.prepare_streaming_cli(cfg, "interactive")
    assert (cfg.generation.stream_capacity, cfg.dataset.batch_size) == (16, 40)
    generator = toy.generator(decoder="var-stream", beam=2, stream_capacity=16)
    assert isinstance(generator.scheduler, streaming.StreamingScheduler) and generator.scheduler.capacity == 16


@pytest.mark.parametrize("settings, message", [
    ({"eps": float("nan")}, "--stream-eps must be a finite number in [0, 1], got nan"),
    ({"eps": float("inf")}, "--stream-eps must be a finite number in [0, 1], got inf"),
    ({"eps": -0.1}, "--stream-eps must be a finite number in [0, 1], got -0.1"),
    ({"capacity": 0}, "--stream-capacity must be an integer >= 1, got 0"),
    ({"capacity_tokens": -1}, "--stream-capacity-tokens must be an integer >= 1, got -1"),
])
def test_the_scheduler_refuses_settings_out_of_range(settings, message):
    """Checked by the scheduler itself, for callers that do not go through task.build_generator."""
    with pytest.raises(ValueError) as refusal:
        streaming.StreamingScheduler(**settings)
    assert str(refusal.value) == message
    scheduler = streaming.StreamingScheduler(capacity=1, capacity_tokens=1, eps=1)
    assert (scheduler.capacity, scheduler.capacity_tokens, scheduler.eps) == (1, 1, 1.0)
