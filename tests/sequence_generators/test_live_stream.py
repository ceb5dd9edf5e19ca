"""fairseq-interactive's lines enter the stream as they arrive: a LiveStream keeps one stream
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
from fairseq_fastgen.sequence_generators.streaming import PADDING_SENTENCE
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


def test_live_arrivals_take_their_first_step_in_the_running_call(toy):
    """greedy-stream on a step engine (rows joined at any length): the few sentences that arrive at a refill get
    no model call of their own for their first step, they join the running rows' next call at their bos; the
    tokens stay greedy's."""
    ids = list(range(TEST_SENTENCES))[:60]
    greedy = toy.translate(toy.generator(decoder="greedy", beam=1), ids)
    generator = toy.generator(decoder="greedy-stream", beam=1, stream_capacity=64, step_engine="static")
    answers, script = live_answers(toy, generator, ids)

    for sentence in ids:
        want, got = greedy[sentence][0], answers[sentence][0]
        assert torch.equal(got["tokens"], want["tokens"]), sentence
        assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-5, rtol=0), sentence
    counts = generator.counters.counts
    assert counts["refills"] >= 10 and script.most_ahead >= 2
    # every call a running step, the stream's or that of its rows set aside (--stream-set-aside): none for a group's
    # start
    assert counts["model_calls"] == counts["iterations"] + counts.get("set_aside_steps", 0)


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


# ---- cancel: a client gives up (fastgen-serve's deadlines and disconnects) ----------------------------
CANCEL_IDS = list(range(0, 46, 2))  # 23 sentences of the toy test set
ARRIVING = {0: 10, 2: 3, 4: 3, 7: 4}  # iteration -> sentences arriving before it; the rest after the cancel
CANCEL_DECODERS = {  # name -> (the stream's options, offline decoding's options, its scores bitwise)
    # joined (the toy model runs on a step engine): a cancelled row waits as a padding row (finished_rows_wait)
    "greedy-stream": (dict(decoder="greedy-stream", beam=1), dict(decoder="greedy", beam=1), False),
    # cohorts of equal length: a cancelled sentence's rows leave, the others are padded again (select_padded)
    "greedy-stream --stream-cohorts": (dict(decoder="greedy-stream", beam=1, stream_cohorts=True),
                                       dict(decoder="greedy-stream", beam=1, stream_cohorts=True), True),
    "blockwise-stream": (dict(decoder="blockwise-stream", beam=1), dict(decoder="blockwise", beam=1), False),
    # fairseq's incremental decoder takes no row in place: a cancelled row goes at once (finished_rows_wait)
    "blockwise-stream --step-engine fairseq": (dict(decoder="blockwise-stream", beam=1, step_engine="fairseq"),
                                               dict(decoder="blockwise", beam=1, step_engine="fairseq"), False),
    "var-stream": (dict(decoder="var-stream", beam=4, nbest=2), dict(decoder="var-stream", beam=4, nbest=2), True),
    "fixed-stream": (dict(decoder="fixed-stream", beam=4), dict(decoder="fixed-stream", beam=4), True),
}


class CancellingServer(LiveStream):
    """fastgen-serve's decoding loop (serve/batching.py, ``ServedStream``) on a scripted load: sentences arrive
    between iterations (ARRIVING), each answer is read once as it finishes; once a sentence was answered and
    three run, the clients of two running sentences, of two waiting ones (in the pool, not admitted yet) and of
    one already answered give up; the sentences not sent yet (three at least) arrive after that.  A cancelled
    sentence not admitted yet is cancelled again once it is (as ``ServedStream._remove`` does)."""

    def __init__(self, toy, generator):
        self.toy, self.unsent, self.incoming, self.order = toy, deque(CANCEL_IDS), [], []  # order: pool -> id
        self.answers, self.leaving, self.cancelled = {}, set(), {}  # cancelled: pool position -> found running
        self.cancel_return, self.cancel_running, self.late = None, None, None
        super().__init__(generator, self.arrivals, lambda count: None)

    def arrivals(self):
        arrived, self.incoming = self.incoming, []
        self.order += arrived
        return [self.toy.sample([sentence])["net_input"] for sentence in arrived]

    def send(self, count):
        self.incoming += [self.unsent.popleft() for _ in range(min(count, len(self.unsent)))]

    def answer(self, net_input):
        results, run = self.pool.results, self.run
        for iteration in range(2000):  # (a hang guard)
            self.send(ARRIVING.get(iteration, 0))
            if self.cancel_return is None:
                self.cancel_some()
            admitted = sorted(p for p in self.leaving if p < run.next_source)  # cancelled again once admitted
            if admitted:
                unfinished = [p for p in admitted if results[p] is None]
                assert self.cancel(admitted) == unfinished  # admitted and not finished: running
                for position in admitted:
                    self.leaving.remove(position)
                    self.cancelled[position] = position in unfinished
            progressed = run.iterate()
            for position in range(self.pool.size):  # each answer read once, as it finishes
                if results[position] is None or results[position] is RETURNED or position in self.leaving:
                    continue
                sentence = self.order[position]
                assert sentence not in self.answers, f"sentence {sentence} answered twice"
                self.answers[sentence], results[position] = results[position], RETURNED
            if not progressed and not self.incoming and iteration > max(ARRIVING):  # (unsent: no cancel came)
                return []
        raise AssertionError("the stream did not end")

    def cancel_some(self):
        results, next_source = self.pool.results, self.run.next_source
        running = [p for p in range(next_source) if results[p] is None]
        waiting = [p for p in range(next_source, self.pool.size) if results[p] is None]
        answered = [p for p in range(next_source) if results[p] is RETURNED]
        if not answered or len(running) < 3 or len(waiting) < 2:
            return
        records = getattr(self.run.policy, "_records", None)  # a beam search's: hypotheses kept per sentence
        holding = [] if records is None else [p for p in running if records.collected[p] or records.waiting[p]]
        if records is not None and not holding and len(answered) < 2:
            return  # a running sentence that holds finished hypotheses is one of those cancelled, where one comes
        leaving = (holding[:1] + [p for p in running[::2] if p not in holding[:1]])[:2]
        gone = leaving + [waiting[0], waiting[-1]] + answered[:1]  # the next to be admitted, the last
        self.cancel_return = self.cancel(gone)
        assert results[answered[0]] is RETURNED  # an answer given stays given
        self.cancelled.update({p: True for p in leaving})
        self.leaving.update([waiting[0], waiting[-1]])
        self.cancel_running, self.late = sorted(leaving), list(self.unsent)
        self.send(len(self.unsent))  # the last sentences arrive after the cancel


@pytest.fixture(scope="module")
def offline_answers():
    """{decoder: {sentence id: hypotheses}}: offline decoding of CANCEL_IDS in one batch, computed once."""
    return {}


@pytest.mark.parametrize("capacity", [3, 8])
@pytest.mark.parametrize("name", CANCEL_DECODERS.keys())
def test_cancelled_sentences_leave_the_stream_the_others_keep_answers(toy, loaded, offline_answers, name,  # noqa: F811
                                                                       capacity):
    streamed_options, offline_options, bitwise = CANCEL_DECODERS[name]
    if name.startswith("blockwise-stream"):
        model, task = loaded(2)
        toy = type(toy)([model], task, task.dataset("test"))  # the k-head toy model
    if name not in offline_answers:
        offline_answers[name] = toy.translate(toy.generator(**offline_options), CANCEL_IDS)
    offline = offline_answers[name]
    generator = toy.generator(stream_capacity=capacity, **streamed_options)
    server = generator.live = CancellingServer(toy, generator)
    generator.generate(None, {"net_input": None})  # the loop runs inside generate(), as fastgen-serve's does

    assert server.cancel_return is not None, "no iteration had an answer given, 3 sentences running and 2 waiting"
    assert server.run.joins_lengths == (name == "greedy-stream" or name.startswith("blockwise"))  # the ways out
    assert server.cancel_return == server.cancel_running  # the running sentences it found, no other
    assert len(server.cancelled) == 4 and not server.leaving  # two running, two cancelled once admitted
    assert sum(server.cancelled.values()) >= 3  # cancelled while their rows ran
    cancelled = {server.order[p] for p in server.cancelled}
    assert set(server.answers) == set(CANCEL_IDS) - cancelled
    assert len(server.late) >= 3 and set(server.late) <= set(server.answers)  # sent after the cancel
    results = server.pool.results
    assert all(results[p] is None for p, running in server.cancelled.items() if running)  # never finished
    assert all(results[p] is RETURNED for p in range(server.pool.size) if p not in server.cancelled)
    assert server.rows == 0 and server.run.cohorts == [] and server.run.next_source == server.pool.size
    expected = {sentence: offline[sentence] for sentence in server.answers}
    if bitwise:
        assert_identical(expected, server.answers, across_batches=True)
    else:  # rows joined at other lengths: the tokens, the scores within float rounding
        for sentence, hypotheses in expected.items():
            want, got = hypotheses[0], server.answers[sentence][0]
            assert len(server.answers[sentence]) == 1
            assert torch.equal(got["tokens"], want["tokens"]), sentence
            assert torch.allclose(got["positional_scores"], want["positional_scores"], atol=1e-5, rtol=0), sentence
            assert abs(float(got["score"]) - float(want["score"])) <= 1e-5, sentence
    records = getattr(generator.policy, "_records", None)  # a beam search's: no cancelled sentence's hypotheses kept
    if records is not None:
        assert all(records.collected[p] == [] and records.waiting[p] == {} for p in server.cancelled)


class SetAsideCanceller(LiveStream):
    """A served stream (greedy-stream, --stream-set-aside 8) whose first row set aside is cancelled by its client
    while it runs there; every sentence arrives at once, one line each, and each answer is read once."""

    def __init__(self, toy, generator, ids):
        self.unsent, self.ids, self.answers, self.cancelled = [toy.sample([s])["net_input"] for s in ids], ids, {}, None
        self.aside_after_cancel = "not cancelled"
        super().__init__(generator, self.arrivals, lambda count: None)

    def arrivals(self):
        arrived, self.unsent = self.unsent, []
        return arrived

    def answer(self, net_input):
        results, run = self.pool.results, self.run
        for _ in range(5000):  # (a hang guard)
            if self.cancelled is None and run.aside.state is not None:
                aside = run.aside.state.sentence
                self.cancelled = int(aside[aside.ne(PADDING_SENTENCE)][0])
                assert self.cancel([self.cancelled]) == [self.cancelled]
                results[self.cancelled] = RETURNED
                state = run.aside.state
                self.aside_after_cancel = [] if state is None else state.sentence.tolist()
            progressed = run.iterate()
            for position, result in enumerate(results):
                if result is not None and result is not RETURNED:
                    assert self.ids[position] not in self.answers
                    self.answers[self.ids[position]], results[position] = result, RETURNED
            if not progressed:
                return []
        raise AssertionError("the stream did not end")


def test_a_row_set_aside_leaves_when_its_client_gives_up(toy):
    ids = list(range(TEST_SENTENCES))[:48]
    greedy = toy.translate(toy.generator(decoder="greedy", beam=1), ids)
    generator = toy.generator(decoder="greedy-stream", beam=1, stream_capacity=8, stream_set_aside=8)
    server = generator.live = SetAsideCanceller(toy, generator, ids)
    generator.generate(None, {"net_input": None})

    assert server.cancelled is not None, "no row was set aside"
    assert server.cancelled not in server.aside_after_cancel  # it left the side state at once
    assert set(server.answers) == set(ids) - {server.ids[server.cancelled]}
    for sentence, hypotheses in server.answers.items():
        assert torch.equal(hypotheses[0]["tokens"], greedy[sentence][0]["tokens"]), sentence
    assert server.rows == 0 and server.run.aside.state is None
