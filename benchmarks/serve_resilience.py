"""Requests across client disconnects and a restart: is any lost, duplicated or crossed?

    python benchmarks/serve_resilience.py --sentences test.en --rate 12 --requests 10000 --disconnect-share 0.1 \\
        --output resilience.json -- fastgen-serve DATA --path CKPT ... --port 8000

Starts the server command given after ``--`` (its output in ``--server-log``), waits for its ``listening on``
line, and sends ``--requests`` requests at Poisson arrivals of ``--rate`` per second, each of 1 to
``--most-sentences`` sentences drawn from ``--sentences``, at most ``--concurrency`` open at once.  The client of
a share ``--disconnect-share`` of them hangs up at a random moment within ``--disconnect-within`` seconds of
sending.  Once ``--restart-at`` of the requests have been sent the server gets SIGTERM (it finishes what it holds
within its ``--grace-period`` and exits); when it has exited it is started again with the same command, while the
arrivals go on.  Every request ends as exactly one of:

* **answered**: 200, one translation per sentence;
* **refused**: 503 (a stopping or full server) or the connection refused (the server was down);
* **disconnected**: its client hung up before the answer came (on purpose);
* **failed**: any other status (504, 500, ...);
* **lost**: no status and not refused: the connection broke under a request.

A request whose connection the server closed before any byte of an answer (aiohttp's
``ServerDisconnectedError``: a kept-alive connection the stopping server closed as the request went out, which
never reached a handler) is sent once more, as browsers and HTTP libraries do for that race (a translation has no
side effect); the report counts these retries.

An answered sentence is **crossed** where its text differs from the text most answers of that source sentence
got (greedy decoders give one translation per sentence whatever shares its batch); a 200 with a wrong number of
translations is **malformed**.  Lost, crossed and malformed must be 0.  The servers' own counters (``/metrics``:
sentences removed by reason) are read before the SIGTERM and at the end, and the servers' exit statuses reported.
"""

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional

from serve_load import Outcome, check_loopback, poisson_schedule, send


@dataclass
class Tally:
    requests: int = 0
    answered: int = 0
    refused: int = 0
    disconnected: int = 0
    failed: int = 0
    lost: int = 0
    lost_errors: dict = field(default_factory=dict)  # the client's exception of each lost request
    crossed_sentences: int = 0
    malformed: int = 0
    statuses: dict = field(default_factory=dict)


def tally(outcomes: List[Outcome], hung_up: List[bool], draws: List[List[str]]) -> Tally:
    """Each request counted once (module doc); ``hung_up[i]``: request i's client hung up before its answer."""
    result = Tally(requests=len(outcomes))
    texts_of = {}  # source sentence -> Counter of the answers it got
    for outcome, hung, texts in zip(outcomes, hung_up, draws):
        if hung:
            kind = "disconnected"
        elif outcome.status == 200:
            kind = "answered"
        elif outcome.status == 503 or outcome.refused_connection:
            kind = "refused"
        elif outcome.status is None:
            kind = "lost"
            result.lost_errors[outcome.error] = result.lost_errors.get(outcome.error, 0) + 1
        else:
            kind = "failed"
        setattr(result, kind, getattr(result, kind) + 1)
        key = kind if kind not in ("failed", "refused") else f"{kind} {outcome.status or 'connection'}"
        result.statuses[key] = result.statuses.get(key, 0) + 1
        if kind == "answered":
            if outcome.texts is None or len(outcome.texts) != len(texts) or None in outcome.texts:
                result.malformed += 1
                continue
            for source, answer in zip(texts, outcome.texts):
                texts_of.setdefault(source, Counter())[answer] += 1
    for answers in texts_of.values():
        result.crossed_sentences += sum(answers.values()) - answers.most_common(1)[0][1]
    return result


# ---- the server ---------------------------------------------------------------------------------------
class ServerProcess:
    """The server command, started (again) on demand; its output appended to ``log_path``."""

    def __init__(self, command: List[str], log_path: str):
        self.command, self.log_path = command, log_path
        self.process: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None

    def start(self, timeout_s: float = 1800):
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, text=True)
        listening = threading.Event()

        def read():
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                found = re.search(r"listening on (http://\S+)", line)
                if found:
                    self.url = found.group(1)
                    listening.set()
            log.close()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(timeout_s) or self.url is None:
            self.process.kill()
            raise SystemExit(f"serve_resilience.py: error: the server did not start; see {self.log_path}")
        check_loopback(self.url)

    def stop(self) -> int:
        """SIGTERM; its exit status once it has exited."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait()


async def removed_counts(url: str) -> dict:
    """The server's ``fastgen_serve_removed_sentences_total`` and ``fastgen_serve_sentences_total`` counters."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    counts = {}
    for line in text.splitlines():
        if line.startswith(("fastgen_serve_removed_sentences_total", "fastgen_serve_sentences_total")):
            name, value = line.rsplit(" ", 1)
            counts[name] = float(value)
    return counts


# ---- the run ---------------------------------------------------------------------------------------------
async def run(args, server: ServerProcess, sentences: List[str]):
    import aiohttp

    rng = random.Random(args.seed)
    schedule = poisson_schedule(args.rate, args.requests, rng)
    draws = [[rng.choice(sentences) for _ in range(rng.randint(1, args.most_sentences))] for _ in schedule]
    hang_ups = [rng.uniform(0, args.disconnect_within) if rng.random() < args.disconnect_share else None
                for _ in schedule]
    outcomes = [Outcome(scheduled=at, sentences=len(texts)) for at, texts in zip(schedule, draws)]
    hung_up = [False] * len(schedule)
    restart_index = int(len(schedule) * args.restart_at)
    report = {"exit_status_after_sigterm": None, "metrics_before_sigterm": None, "metrics_at_the_end": None,
              "retried_after_a_closed_connection": 0}
    slots = asyncio.Semaphore(args.concurrency)
    loop = asyncio.get_running_loop()

    async def restart():
        report["metrics_before_sigterm"] = await removed_counts(server.url)
        report["exit_status_after_sigterm"] = await loop.run_in_executor(None, server.stop)
        print(f"server stopped (exit status {report['exit_status_after_sigterm']}); starting it again",
              file=sys.stderr, flush=True)
        began = time.monotonic()
        await loop.run_in_executor(None, server.start)
        report["restart_seconds"] = time.monotonic() - began
        print(f"server listening again after {report['restart_seconds']:.1f} s", file=sys.stderr, flush=True)

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.monotonic()

        async def send_retrying(index):
            outcome = outcomes[index]
            await send(session, server.url, draws[index], False, outcome, t0)
            if outcome.status is None and outcome.error == "ServerDisconnectedError":  # (module doc)
                report["retried_after_a_closed_connection"] += 1
                outcome.error = None
                await send(session, server.url, draws[index], False, outcome, t0)

        async def one(index):
            try:
                if hang_ups[index] is None:
                    await send_retrying(index)
                else:
                    try:
                        await asyncio.wait_for(send_retrying(index), hang_ups[index])
                    except asyncio.TimeoutError:
                        hung_up[index] = True
            finally:
                slots.release()

        tasks, restarting = [], None
        for index, outcome in enumerate(outcomes):
            if index == restart_index:
                restarting = asyncio.ensure_future(restart())
            delay = t0 + outcome.scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.ensure_future(one(index)))
            if index and index % 1000 == 0:
                print(f"{index} requests sent", file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
        if restarting is not None:
            await restarting
    report["metrics_at_the_end"] = await removed_counts(server.url)
    return tally(outcomes, hung_up, draws), report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("serve_resilience.py: error: give the server command after --")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="serve_resilience.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", required=True, help="text file: one sentence a line, drawn at random")
    p.add_argument("--rate", type=float, default=10.0, help="offered load, requests/s")
    p.add_argument("--requests", type=int, default=10000, help="requests in all")
    p.add_argument("--most-sentences", type=int, default=3, help="sentences in a request: 1 to this many")
    p.add_argument("--concurrency", type=int, default=512, help="requests open at once, at most")
    p.add_argument("--disconnect-share", type=float, default=0.1, help="share of requests whose client hangs up")
    p.add_argument("--disconnect-within", type=float, default=2.0, help="seconds: when such a client hangs up")
    p.add_argument("--restart-at", type=float, default=0.5, help="share of the requests sent before the SIGTERM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default="serve_resilience.server.log")
    p.add_argument("--output", default=None, help="write the counts here (JSON)")
    args = p.parse_args(argv[:split])
    with open(args.sentences, encoding="utf-8") as lines:
        sentences = [line.strip() for line in lines if line.strip()]
    server = ServerProcess(argv[split + 1:], args.server_log)
    server.start()
    try:
        counts, report = asyncio.run(run(args, server, sentences))
    finally:
        final_status = server.stop()
    report.update(counts.__dict__, exit_status_at_the_end=final_status)
    print(json.dumps(report, indent=1))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=1)
    return report


if __name__ == "__main__":
    main()
