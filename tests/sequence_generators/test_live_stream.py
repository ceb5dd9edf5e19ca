"""fairseq-interactive's lines enter the stream as they arrive (issue 28): a LiveStream keeps one stream
across generate() calls, takes in the lines read meanwhile at each refill, and answers each call's sentences
exactly as the decoder does on one static batch; fairseq-interactive answers every line once, in input
order, each as soon as it and every earlier line are done."""

import collections
import os
import re
import selectors
import subprocess
from collections import deque

import pytest
import torch

from fairseq_fastgen.commands import fairseq_command
from fairseq_fastgen.sequence_generators.live_stream import RETURNED, LiveStream
from test_blockwise import loaded  # noqa: F401  (the k-head fixture)
from test_var_beam import TEST_SENTENCES, assert_identical, toy  # noqa: F401

BURSTS = [0, 3, 0, 0, 1, 7, 0, 2, 0, 0, 0, 5, 1, 1, 0, 4]  # lines read before each refill, cycled


class ScriptedInput:
    """A stand-in for fairseq-interactive's reader: sentence ids arrive in bursts, one burst per refill;
    ``read_next`` is fairseq's loop reading the next line itself (when the stream has not taken it in)."""

    def __init__(self, toy, ids):
        self.toy, self.waiting, self.taken_in = toy, deque(ids), set()
        self.bursts, self.admitted_count, self.most_ahead = 0, 0, 0

    def arrivals(self):
        burst = BURSTS[self.bursts % len(BURSTS)]
        self.bursts += 1
        arrived = [self.waiting.popleft() for _ in range(min(burst, len(self.waiting)))]
        self.taken_in.update(arrived)
        return [self.toy.sample([sentence])["net_input"] for sentence in arrived]

    def admitted(self, count):
        self.admitted_count += count

    def answer_in_order(self, generator, ids):
        """fairseq-interactive's loop: each line in turn, batched alone, answered by the generator."""
        answers = {}
        for sentence in ids:
            if sentence not in self.taken_in:
                assert self.waiting.popleft() == sentence  # read by the loop itself
            answers[sentence] = generator.generate(None, self.toy.sample([sentence]))[0]
            # sentences of later lines already in the stream when this one was answered
            self.most_ahead = max(self.most_ahead, generator.live.run.next_source - len(answers))
        return answers


def live_answers(toy, generator, ids):
    script = ScriptedInput(toy, ids)
    generator.live = LiveStream(generator, script.arrivals, script.admitted)
    answers = script.answer_in_order(generator, ids)
    assert script.admitted_count == len(ids)  # every line entered the stream once
    assert script.taken_in  # the stream took lines in ahead of the loop's requests
    pool = generator.live.pool  # keeps nothing of a sentence once it is answered but its lengths
    assert pool.size == len(ids) and all(tokens is None for tokens in pool.tokens)
    assert all(results is RETURNED for results in pool.results)
    return {sentence: [h for h in hypotheses] for sentence, hypotheses in answers.items()}, script


@pytest.mark.parametrize("decoder, options", [
    ("greedy-stream", dict(beam=1, stream_cohorts=True)),  # its form whose scores do not depend on companions
    ("var-stream", dict(beam=4, nbest=2, no_repeat_ngram_size=2)),
    ("fixed-stream", dict(beam=4, max_len_a=0, max_len_b=3)),  # sentences cut at the length limit
])
def test_live_stream_answers_each_call_as_one_static_batch(toy, decoder, options):
    ids = list(range(TEST_SENTENCES))[:60]
    static = toy.translate(toy.generator(decoder=decoder, **options), ids)  # no capacity: one batch
    generator = toy.generator(decoder=decoder, stream_capacity=5, stream_eps=0.5, **options)
    answers, script = live_answers(toy, generator, ids)

    assert_identical(static, answers, across_batches=True)
    assert script.most_ahead >= 2  # later lines decoded beside the one being answered
    assert generator.counters.counts["refills"] >= 10


def test_live_blockwise_stream_gives_blockwise_outputs(loaded):  # noqa: F811
    model, task = loaded(2)
    dataset = task.dataset("test")
    live_toy = type("Loaded", (), {"sample": lambda self, ids: dataset.collater([dataset[i] for i in ids])})()
    ids = list(range(min(40, len(dataset))))
    from fairseq.dataclass.configs import GenerationConfig

    blockwise = task.build_generator([model], GenerationConfig(beam=1, decoder="blockwise"))
    batch = live_toy.sample(ids)  # sorted by source length
    reference = dict(zip(batch["id"].tolist(), blockwise.generate([model], batch)))
    generator = task.build_generator([model], GenerationConfig(beam=1, decoder="blockwise-stream",
                                                               stream_capacity=4))
    answers, script = live_answers(live_toy, generator, ids)
    for sentence in ids:
        want, got = reference[sentence][0], answers[sentence][0]
        assert torch.equal(got["tokens"], want["tokens"]), sentence
        assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-5, rtol=0), sentence
    assert script.most_ahead >= 2


# ---- fairseq-interactive ------------------------------------------------------------------------
def interactive_command(toy_model, plugin_dir, *extra):
    return fairseq_command("interactive") + [
        str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
        "--source-lang", "en", "--target-lang", "fr", *extra]


class OutputLines:
    """A process's output read as it comes (raw reads: a buffered reader would hold lines a selector misses)."""

    def __init__(self, process):
        self.fd, self.pending = process.stdout.fileno(), ""
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.fd, selectors.EVENT_READ)

    def until(self, pattern, deadline_s=300):
        """The lines up to the first one matching ``pattern`` (the deadline is a hang guard, not a timing)."""
        lines = []
        while True:
            while "\n" in self.pending:
                line, self.pending = self.pending.split("\n", 1)
                lines.append(line)
                if re.match(pattern, line):
                    return lines
            chunk = os.read(self.fd, 65536) if self.selector.select(timeout=deadline_s) else b""
            if not chunk:
                raise AssertionError(f"no line matching {pattern!r}; got {lines[-20:]}")
            self.pending += chunk.decode()


def test_each_line_is_answered_before_the_next_is_written(toy_model, plugin_dir):
    """With --buffer-size 8 a line is answered without waiting for 8 lines (stock waits for a full buffer)."""
    sources = (toy_model.raw / "test.en").read_text().split("\n")[:4]
    command = interactive_command(toy_model, plugin_dir, "--beam", "1", "--decoder", "greedy-stream",
                                  "--buffer-size", "8", "--batch-size", "4")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env)
    output = OutputLines(process)
    try:
        for sentence, source in enumerate(sources):
            process.stdin.write(source + "\n")
            process.stdin.flush()
            answer = output.until(rf"^P-{sentence}\t")
            assert [line.split("\t")[0] for line in answer[-5:]] == [f"{kind}-{sentence}" for kind in "SWHDP"]
        process.stdin.close()
        assert process.wait(timeout=300) == 0
    finally:
        process.kill()


def test_every_line_answered_once_in_order_with_refusals(toy_model, plugin_dir):
    """var-stream at beam 4, nbest 2: an empty line, a line beyond the model's positions (refused on stderr,
    exit status 1 at the end) and 20 others; each answered once, in order, with var-batch's hypotheses
    (var-batch: each --buffer-size block one batch)."""
    words = (toy_model.raw / "test.en").read_text().split()
    sources = (toy_model.raw / "test.en").read_text().split("\n")[:20]
    sources[3:3] = ["", " ".join(words[:200])]  # line 3 empty, line 4 too long
    options = ["--beam", "4", "--nbest", "2", "--buffer-size", "6", "--batch-size", "3"]
    outputs = {}
    for decoder in ("var-batch", "var-stream"):
        completed = subprocess.run(interactive_command(toy_model, plugin_dir, *options, "--decoder", decoder),
                                   input="\n".join(sources) + "\n", capture_output=True, text=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert completed.returncode == 1, completed.stderr[-2000:]
        assert "sentence 4 has" in completed.stderr and "(sentence ids 4)" in completed.stderr
        outputs[decoder] = completed.stdout
    answered = [int(m) for m in re.findall(r"^S-(\d+)\t", outputs["var-stream"], flags=re.M)]
    assert answered == [i for i in range(len(sources)) if i != 4]
    hypotheses = lambda out: re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, flags=re.M)  # noqa: E731
    assert hypotheses(outputs["var-stream"]) == hypotheses(outputs["var-batch"])
    counts = collections.Counter(int(sentence) for sentence, _ in hypotheses(outputs["var-stream"]))
    assert sorted(counts) == answered and set(counts.values()) <= {1, 2}  # var-beam may keep fewer than nbest
