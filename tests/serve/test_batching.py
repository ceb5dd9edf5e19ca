"""Continuous batching's admission: the stream takes, besides a sentence for each of its rows, a quarter more that
wait there for rows, so that it encodes arrivals together instead of one encoder call per refill of one or two
sentences; and a stream whose refills take finished rows' places refills once half its rows are free, unless
--stream-eps says otherwise (fairseq_fastgen/serve/batching.py; the speed it buys: docs/serving.md)."""

from types import SimpleNamespace

import pytest

from fairseq_fastgen.serve.batching import SERVED_EPS, ContinuousBatching, Job
from fairseq_fastgen.sequence_generators.streaming import COHORT_EPS, JOINED_EPS


class Metrics:
    def __init__(self):
        self.gauges = {}

    def set(self, name, value):
        self.gauges[name] = value

    def inc(self, name, **labels):
        pass


def continuous(capacity, eps=JOINED_EPS, given_eps=None):
    scheduler = SimpleNamespace(capacity=capacity, capacity_rows=None, capacity_tokens=None, eps=eps)
    translator = SimpleNamespace(generator=SimpleNamespace(scheduler=scheduler),
                                 cfg=SimpleNamespace(generation=SimpleNamespace(stream_eps=given_eps)))
    return ContinuousBatching(translator, Metrics(), max_queue=1000)


def ids(net_inputs):
    return [net_input["id"] for net_input in net_inputs]


def test_the_stream_takes_its_rows_and_a_quarter_more_then_one_sentence_per_answer():
    batching, answered = continuous(capacity=8), []
    jobs = [Job(SimpleNamespace(net_input={"id": i}), answered.append) for i in range(20)]
    batching.submit(jobs)
    assert ids(batching.arrivals(0)) == list(range(10))  # 8 rows, 2 waiting in the stream for rows
    assert batching.metrics.gauges["fastgen_serve_queue_sentences"] == 10
    assert batching.arrivals(10) == []  # full until an answer leaves
    batching.finished(3, ["hypotheses of 3"])
    assert answered == [["hypotheses of 3"]]
    assert ids(batching.arrivals(10)) == [10]
    assert sorted(batching.in_stream) == [0, 1, 2] + list(range(4, 11))


def test_a_small_stream_still_takes_one_sentence_ahead():
    batching = continuous(capacity=2)
    batching.submit([Job(SimpleNamespace(net_input={"id": i}), lambda result: None) for i in range(5)])
    assert ids(batching.arrivals(0)) == [0, 1, 2]


@pytest.mark.parametrize("eps, given, served", [(JOINED_EPS, None, SERVED_EPS), (JOINED_EPS, 1.0, JOINED_EPS),
                                                (COHORT_EPS, None, COHORT_EPS)])
def test_a_joined_stream_refills_at_half_its_rows_unless_told(eps, given, served):
    assert continuous(capacity=8, eps=eps, given_eps=given).translator.generator.scheduler.eps == served
