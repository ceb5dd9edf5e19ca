"""Load generator for fastgen-serve: Poisson arrivals at given rates, latency percentiles, goodput, a p99 plot.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --sentences data/test.en \\
        --rates 5,10,20,40 --requests 2000 --concurrency 256 --slo-ms 500 --output load.json --plot p99.png

Per offered rate (requests per second), ``--requests`` requests are sent at Poisson arrival times (exponential
gaps, seeded), each with ``--sentences-per-request`` sentences drawn at random from ``--sentences`` (so sentence
lengths follow that test set), at most ``--concurrency`` of them open at once (an arrival past that waits for a
free slot; its latency still counts from its scheduled arrival, so a saturated server is not flattered) and no
longer than ``--max-seconds`` per rate.  Reported per rate:

* p50 / p95 / p99 end-to-end latency of the answered requests (linear interpolation between order statistics,
  numpy's default), and with ``--stream`` time to the first streamed line;
* sentences/s and tokens/s answered (tokens: the answers' H- tokens), over the time from the first arrival to the
  last answer;
* goodput: requests (and sentences) answered within ``--slo-ms``, per second;
* refused (503: a full queue or a stopping server; and connections refused) and failed (any other status, 504
  included, or a broken connection) requests.

Only loopback addresses are loaded (the generator is a benchmark of this machine's server, not a tool to load
other hosts).  ``--plot`` draws p99 latency against the offered load, one line per results file given with
``--compare`` beside this run's.
"""

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional
from urllib.parse import urlparse

import numpy

LOOPBACK_NAMES = ("localhost",)


@dataclass
class Outcome:
    """One request: when it was due, how it ended."""

    scheduled: float  # seconds since the rate's start: its Poisson arrival time
    sentences: int
    status: Optional[int] = None  # HTTP status, None where the connection failed
    latency: Optional[float] = None  # seconds from ``scheduled`` to the whole answer
    first_line: Optional[float] = None  # seconds from ``scheduled`` to the first streamed line (--stream)
    tokens: int = 0  # tokens of the answers (their H- text, split on spaces)
    refused_connection: bool = False
    texts: Optional[List[Optional[str]]] = None  # a 200's translations (D- text), one per sentence in order
    error: Optional[str] = None  # the client's exception where the request got no status


@dataclass
class RateReport:
    offered_rate: float  # requests per second asked for
    requests: int  # sent
    answered: int  # 200
    refused: int  # 503 or connection refused
    failed: int  # any other status, or a broken connection
    elapsed_s: float  # first arrival to last answer
    p50_ms: Optional[float]
    p95_ms: Optional[float]
    p99_ms: Optional[float]
    first_line_p50_ms: Optional[float]
    first_line_p99_ms: Optional[float]
    sentences_per_s: float
    tokens_per_s: float
    goodput_requests_per_s: float  # answered within the objective
    goodput_sentences_per_s: float
    slo_ms: float
    statuses: dict = field(default_factory=dict)


# ---- arrivals and statistics (pure: tested without a server) ----------------------------------------
def poisson_schedule(rate: float, count: int, rng: random.Random, max_seconds: Optional[float] = None) -> List[float]:
    """``count`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second: exponential gaps of
    mean 1 / rate; those past ``max_seconds`` are left out."""
    if rate <= 0:
        raise ValueError(f"a rate must be above 0; got {rate}")
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        if max_seconds is not None and now > max_seconds:
            break
        times.append(now)
    return times


def percentile_ms(values: List[float], q: float) -> Optional[float]:
    return None if not values else float(numpy.percentile(numpy.asarray(values), q)) * 1000


def summarize(offered_rate: float, outcomes: List[Outcome], slo_s: float) -> RateReport:
    answered = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 503 or o.refused_connection]
    failed = len(outcomes) - len(answered) - len(refused)
    latencies = [o.latency for o in answered]
    first_lines = [o.first_line for o in answered if o.first_line is not None]
    ends = [o.scheduled + o.latency for o in outcomes if o.latency is not None]
    start = min((o.scheduled for o in outcomes), default=0.0)
    elapsed = max(ends, default=start) - start
    per_s = (lambda amount: amount / elapsed) if elapsed > 0 else (lambda amount: 0.0)
    good = [o for o in answered if o.latency <= slo_s]
    statuses = {}
    for o in outcomes:
        key = "connection refused" if o.refused_connection else ("no answer" if o.status is None else str(o.status))
        statuses[key] = statuses.get(key, 0) + 1
    return RateReport(
        offered_rate=offered_rate, requests=len(outcomes), answered=len(answered), refused=len(refused),
        failed=failed, elapsed_s=elapsed,
        p50_ms=percentile_ms(latencies, 50), p95_ms=percentile_ms(latencies, 95), p99_ms=percentile_ms(latencies, 99),
        first_line_p50_ms=percentile_ms(first_lines, 50), first_line_p99_ms=percentile_ms(first_lines, 99),
        sentences_per_s=per_s(sum(o.sentences for o in answered)), tokens_per_s=per_s(sum(o.tokens for o in answered)),
        goodput_requests_per_s=per_s(len(good)), goodput_sentences_per_s=per_s(sum(o.sentences for o in good)),
        slo_ms=slo_s * 1000, statuses=statuses,
    )


# ---- sending ---------------------------------------------------------------------------------------
def check_loopback(url: str):
    host = urlparse(url).hostname
    if host in LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"serve_load.py: error: --url {url}: only loopback addresses (127.0.0.0/8, ::1, localhost)")


async def send(session, url: str, texts: List[str], stream: bool, outcome: Outcome, t0: float):
    import aiohttp

    body = {"text": texts, "stream": True} if stream else {"text": texts}
    try:
        async with session.post(url + "/translate", json=body) as response:
            outcome.status = response.status
            if stream and response.status == 200:
                outcome.texts = [None] * len(texts)
                async for line in response.content:
                    if outcome.first_line is None:
                        outcome.first_line = time.monotonic() - t0 - outcome.scheduled
                    record = json.loads(line)
                    if "translation" in record:
                        outcome.tokens += len(record["translation"]["tokens"].split())
                        outcome.texts[record["sentence"]] = record["translation"]["text"]
                    if "error" in record:
                        outcome.status = record["status"]
            else:
                reply = await response.read()
                if response.status == 200:
                    translations = json.loads(reply)["translations"]
                    outcome.tokens = sum(len(t["tokens"].split()) for t in translations)
                    outcome.texts = [t["text"] for t in translations]
    except aiohttp.ClientConnectorError as error:
        outcome.refused_connection = isinstance(error.os_error, ConnectionRefusedError)
        outcome.error = type(error).__name__
        return
    except (aiohttp.ClientError, asyncio.TimeoutError, socket.error) as error:
        outcome.status, outcome.error = None, type(error).__name__
        return
    outcome.latency = time.monotonic() - t0 - outcome.scheduled


async def run_rate(url: str, sentences: List[str], rate: float, count: int, per_request: int, concurrency: int,
                   max_seconds: Optional[float], stream: bool, rng: random.Random) -> List[Outcome]:
    import aiohttp

    schedule = poisson_schedule(rate, count, rng, max_seconds)
    draws = [[rng.choice(sentences) for _ in range(per_request)] for _ in schedule]
    slots = asyncio.Semaphore(concurrency)
    outcomes = [Outcome(scheduled=at, sentences=per_request) for at in schedule]
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.monotonic()

        async def one(outcome, texts):
            try:
                await send(session, url, texts, stream, outcome, t0)
            finally:
                slots.release()

        tasks = []
        for outcome, texts in zip(outcomes, draws):
            delay = t0 + outcome.scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()  # bounded concurrency: a late start still counts from its scheduled time
            tasks.append(asyncio.ensure_future(one(outcome, texts)))
        await asyncio.gather(*tasks)
    return outcomes


# ---- command line ------------------------------------------------------------------------------------
def rate_list(text: str) -> List[float]:
    try:
        rates = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates above 0, got {text!r}")
    return rates


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (a loopback address)")
    p.add_argument("--sentences", required=True, help="text file: one sentence a line, drawn at random")
    p.add_argument("--rates", type=rate_list, required=True, help="comma-separated offered loads, requests/s")
    p.add_argument("--requests", type=int, default=2000, help="requests per rate")
    p.add_argument("--sentences-per-request", type=int, default=1, help="sentences in each request")
    p.add_argument("--concurrency", type=int, default=256, help="requests open at once, at most")
    p.add_argument("--max-seconds", type=float, default=None, help="no arrival later than this, per rate")
    p.add_argument("--slo-ms", type=float, default=500.0, help="latency objective of the goodput, milliseconds")
    p.add_argument("--stream", action="store_true", help="ask for streamed answers; report time to first line")
    p.add_argument("--warmup", type=int, default=20,
                   help="requests sent one at a time before the first rate, not reported (the server's first "
                        "calls allocate and warm its caches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and of the sentences drawn")
    p.add_argument("--label", default="fastgen-serve", help="this run's name in the plot and the results")
    p.add_argument("--output", default=None, help="write the reports here (JSON)")
    p.add_argument("--plot", default=None, help="draw p99 latency against offered load here (PNG)")
    p.add_argument("--compare", nargs="*", default=[], help="results files (--output of other runs) to plot beside")
    return p


def print_table(label: str, reports: List[RateReport], file=sys.stdout):
    fmt = lambda value: "-" if value is None else f"{value:.1f}"  # noqa: E731
    print(f"{label}: latency objective {reports[0].slo_ms:g} ms" if reports else label, file=file)
    print("| offered req/s | sent | answered | refused | failed | p50 ms | p95 ms | p99 ms | first line p99 ms | "
          "sentences/s | tokens/s | goodput req/s |", file=file)
    print("|" + " --- |" * 12, file=file)
    for r in reports:
        print(f"| {r.offered_rate:g} | {r.requests} | {r.answered} | {r.refused} | {r.failed} | {fmt(r.p50_ms)} | "
              f"{fmt(r.p95_ms)} | {fmt(r.p99_ms)} | {fmt(r.first_line_p99_ms)} | {r.sentences_per_s:.1f} | "
              f"{r.tokens_per_s:.1f} | {r.goodput_requests_per_s:.1f} |", file=file, flush=True)


def plot(path: str, runs: dict):
    """p99 latency (ms) against offered load (requests/s), one line per run: {label: [report dicts]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, reports in runs.items():
        points = [(r["offered_rate"], r["p99_ms"]) for r in reports if r["p99_ms"] is not None]
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    axes.set_xlabel("offered load (requests/s)")
    axes.set_ylabel("p99 latency (ms)")
    axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> List[RateReport]:
    args = parser().parse_args(argv)
    check_loopback(args.url)
    for name in ("requests", "sentences_per_request", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"serve_load.py: error: --{name.replace('_', '-')} must be at least 1")
    with open(args.sentences, encoding="utf-8") as lines:
        sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise SystemExit(f"serve_load.py: error: --sentences {args.sentences} has no sentence")
    rng = random.Random(args.seed)
    if args.warmup > 0:
        asyncio.run(run_rate(args.url, sentences, 1e6, args.warmup, args.sentences_per_request, 1, None, False,
                             random.Random(args.seed)))
    reports = []
    for rate in args.rates:
        outcomes = asyncio.run(run_rate(args.url, sentences, rate, args.requests, args.sentences_per_request,
                                        args.concurrency, args.max_seconds, args.stream, rng))
        reports.append(summarize(rate, outcomes, args.slo_ms / 1000))
        last = reports[-1]
        print(f"offered {rate:g} req/s: {last.answered} answered, {last.refused} refused, {last.failed} failed, "
              f"p99 {last.p99_ms} ms", file=sys.stderr, flush=True)
    runs = {args.label: [asdict(r) for r in reports]}
    if args.output:
        with open(args.output, "w") as out:
            json.dump(runs, out, indent=1)
    for path in args.compare:
        with open(path) as results:
            runs.update(json.load(results))
    if args.plot:
        plot(args.plot, runs)
    print_table(args.label, reports)
    return reports


if __name__ == "__main__":
    main()
