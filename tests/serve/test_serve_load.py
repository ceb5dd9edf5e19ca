"""benchmarks/serve_load.py: its arrivals, percentiles and counts, against a stub server (no model)."""

import asyncio
import json
import random
import sys
import threading
from pathlib import Path

import numpy
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_load  # noqa: E402


def test_poisson_schedule_has_the_rate_and_count():
    times = serve_load.poisson_schedule(50.0, 20000, random.Random(1))
    gaps = numpy.diff([0.0] + times)
    assert len(times) == 20000 and all(g > 0 for g in gaps)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)  # 20,000 exponential gaps: the mean within 3%
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)  # exponential: standard deviation = mean
    assert serve_load.poisson_schedule(50.0, 20000, random.Random(1)) == times  # seeded
    bounded = serve_load.poisson_schedule(50.0, 20000, random.Random(1), max_seconds=10.0)
    assert bounded == [t for t in times if t <= 10.0]


def test_summary_percentiles_goodput_and_counts():
    latencies = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    outcomes = [serve_load.Outcome(scheduled=i * 0.1, sentences=2, status=200, latency=latency, tokens=5)
                for i, latency in enumerate(latencies)]
    outcomes += [serve_load.Outcome(scheduled=0.05, sentences=2, status=503),
                 serve_load.Outcome(scheduled=0.06, sentences=2, refused_connection=True),
                 serve_load.Outcome(scheduled=0.07, sentences=2, status=504, latency=0.5),
                 serve_load.Outcome(scheduled=0.08, sentences=2, status=None)]
    report = serve_load.summarize(10.0, outcomes, slo_s=0.050)
    assert (report.requests, report.answered, report.refused, report.failed) == (104, 100, 2, 2)
    assert report.p50_ms == pytest.approx(50.5)
    assert report.p95_ms == pytest.approx(95.05)
    assert report.p99_ms == pytest.approx(99.01)
    elapsed = 99 * 0.1 + 0.100  # the first arrival (0) to the last answer (9.9 s + 100 ms)
    assert report.elapsed_s == pytest.approx(elapsed)
    assert report.sentences_per_s == pytest.approx(200 / elapsed)
    assert report.tokens_per_s == pytest.approx(500 / elapsed)
    assert report.goodput_requests_per_s == pytest.approx(50 / elapsed)  # 1..50 ms are within 50 ms
    assert report.goodput_sentences_per_s == pytest.approx(100 / elapsed)
    assert report.statuses == {"200": 100, "503": 1, "connection refused": 1, "504": 1, "no answer": 1}


class StubServer:
    """/translate answers every request but each 4th (503) with one translation of 3 tokens per sentence."""

    def __init__(self):
        self.requests = 0
        self.sentences = 0
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(60)

    async def translate(self, request):
        body = await request.json()
        self.requests += 1
        if self.requests % 4 == 0:
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "1"})
        self.sentences += len(body["text"])
        if body.get("stream"):
            response = web.StreamResponse()
            await response.prepare(request)
            for index, _ in enumerate(body["text"]):
                line = {"sentence": index, "translation": {"text": "a b c", "tokens": "a b c", "score": -1.0}}
                await response.write((json.dumps(line) + "\n").encode())
            await response.write(b'{"done": true}\n')
            return response
        return web.json_response({"translations": [{"text": "a b c", "tokens": "a b c", "score": -1.0}
                                                   for _ in body["text"]]})

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.add_routes([web.post("/translate", self.translate)])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


@pytest.mark.parametrize("stream", [False, True])
def test_counts_against_a_stub_server(tmp_path, stream):
    stub = StubServer()
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("one\ntwo three\n\nfour five six\n")
    try:
        reports = serve_load.main(["--url", stub.url, "--sentences", str(sentences), "--rates", "400,800",
                                   "--requests", "40", "--sentences-per-request", "2", "--concurrency", "8",
                                   "--warmup", "0", "--output", str(tmp_path / "load.json"),
                                   "--plot", str(tmp_path / "p99.png")]
                                  + (["--stream"] if stream else []))
    finally:
        stub.close()
    assert [r.offered_rate for r in reports] == [400, 800]
    for report in reports:
        assert (report.requests, report.answered, report.refused, report.failed) == (40, 30, 10, 0)
        assert report.sentences_per_s == pytest.approx(60 / report.elapsed_s)
        assert report.tokens_per_s == pytest.approx(180 / report.elapsed_s)
        assert (report.first_line_p99_ms is not None) == stream
    assert stub.requests == 80 and stub.sentences == 120
    assert json.loads((tmp_path / "load.json").read_text())["fastgen-serve"][0]["answered"] == 30
    assert (tmp_path / "p99.png").stat().st_size > 0


def test_only_loopback_addresses():
    with pytest.raises(SystemExit, match="only loopback"):
        serve_load.check_loopback("http://10.1.2.3:8000")
    serve_load.check_loopback("http://127.0.0.1:8000")
    serve_load.check_loopback("http://[::1]:8000")
    serve_load.check_loopback("http://localhost:8000")


def test_resilience_tally_counts_each_request_once_and_finds_crossed_answers():
    import serve_resilience

    Outcome = serve_load.Outcome
    draws = [["a", "b"], ["a"], ["b", "a"], ["c"], ["a"], ["b"], ["c"], ["a"], ["c"]]
    outcomes = [
        Outcome(0.0, 2, status=200, texts=["A", "B"]),
        Outcome(0.1, 1, status=200, texts=["A"]),
        Outcome(0.2, 2, status=200, texts=["B", "X"]),  # "a" answered "X" where its other answers are "A": crossed
        Outcome(0.3, 1, status=200, texts=[]),  # a translation missing: malformed
        Outcome(0.4, 1, status=503),
        Outcome(0.5, 1, refused_connection=True),
        Outcome(0.6, 1, status=None, error="ClientOSError"),  # the connection broke under it: lost
        Outcome(0.7, 1, status=None),  # its client hung up (below): disconnected, not lost
        Outcome(0.8, 1, status=504),
    ]
    hung_up = [False] * 7 + [True, False]
    counts = serve_resilience.tally(outcomes, hung_up, draws)
    assert (counts.requests, counts.answered, counts.refused, counts.disconnected, counts.failed, counts.lost) == \
        (9, 4, 2, 1, 1, 1)
    assert (counts.crossed_sentences, counts.malformed) == (1, 1)
    assert counts.lost_errors == {"ClientOSError": 1}
    assert counts.statuses == {"answered": 4, "refused 503": 1, "refused connection": 1, "lost": 1,
                               "disconnected": 1, "failed 504": 1}
