"""Where a served stream's time goes: fastgen-serve's batching under Poisson arrivals, in one process, without HTTP
(not part of the product).

    python benchmarks/serve_iterations.py DATA_BIN SOURCES --rate 20 --sentences 600 -- [fastgen-serve options]

Builds the server as ``fastgen-serve`` does (the options after ``--`` are its own: ``--path``, ``--decoder``,
``--batching``, ``--quantize``, ...), but hands its decoding thread one sentence a request at Poisson arrival times
from this process instead of HTTP clients, so that the decoding alone is measured. Prints the latency percentiles
(from each sentence's scheduled arrival), the decoding thread's busy share, and for a stream (``--batching
continuous``) its iterations by rows and by whether a refill entered them, with their median durations.
"""

import argparse
import collections
import logging
import random
import statistics
import sys
import threading
import time

import torch

from serve_load import percentile_ms, poisson_schedule  # (benchmarks/: the load generator's own, tested)

from fairseq_fastgen.sequence_generators.streaming import StreamRun
from fairseq_fastgen.serve.batching import Job
from fairseq_fastgen.serve.options import parse_command_line
from fairseq_fastgen.serve.server_setup import build_server

WARM_UP = 20  # sentences sent first, left out of the figures


class IterationLog:
    """(start, seconds, rows, sentences admitted) of every stream iteration: ``StreamRun.iterate`` timed from
    outside (instrumentation of this script only)."""

    def __init__(self):
        self.iterations = []
        iterate = StreamRun.iterate

        def timed(run):
            start, admitted = time.perf_counter(), run.next_source
            more = iterate(run)
            rows = sum(state.rows for state in run.states)  # (the rows set aside too, as LiveStream.rows)
            self.iterations.append((start, time.perf_counter() - start, rows, run.next_source - admitted))
            return more

        StreamRun.iterate = timed

    def report(self, since: float, wall: float):
        measured = [i for i in self.iterations if i[0] >= since]
        if not measured:
            return
        busy = sum(i[1] for i in measured)
        print(f"stream: {len(measured)} iterations, {busy / wall:.0%} of the time busy, "
              f"{statistics.mean(i[2] for i in measured):.1f} rows on average")
        groups = collections.defaultdict(list)
        for _, seconds, rows, admitted in measured:
            groups[(rows, admitted > 0)].append(seconds)
        for (rows, refill), seconds in sorted(groups.items()):
            if len(seconds) >= 10:
                print(f"  {rows:3d} rows{' + a refill' if refill else ''}: {len(seconds):5d} iterations, median "
                      f"{1000 * statistics.median(seconds):.2f} ms")
        # what a refill adds to its iteration, by the sentences it admits: over the median of the iterations of as
        # many rows without one (the figures serve_policy_model.py takes as its --start-ms and --start-ms-each)
        steps = {rows: statistics.median(s) for (rows, refill), s in groups.items() if not refill and len(s) >= 5}
        added = collections.defaultdict(list)
        for _, seconds, rows, admitted in measured:
            if admitted and rows in steps:
                added[admitted].append(seconds - steps[rows])
        for admitted, extra in sorted(added.items()):
            if len(extra) >= 5:
                print(f"  a refill of {admitted} sentence(s): {len(extra):5d} iterations, adds a median "
                      f"{1000 * statistics.median(extra):.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("sources", help="a text file of source sentences, drawn at random")
    parser.add_argument("--rate", type=float, default=20.0, help="sentences per second (Poisson arrivals)")
    parser.add_argument("--sentences", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    own, options = (sys.argv[1:], []) if "--" not in sys.argv else (
        sys.argv[1: sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:])  # fastgen-serve's after "--"
    args = parser.parse_args(own)
    torch.set_num_threads(1)
    logging.getLogger("filelock").setLevel(logging.WARNING)  # (a line per compiled unit's lock otherwise)
    sys.argv = [sys.argv[0], args.data_bin] + options  # (fairseq's parser reads sys.argv for --user-dir)
    server_args, cfg = parse_command_line(sys.argv[1:])
    log = IterationLog()
    server = build_server(server_args, cfg)
    batching, translator = server.batching, server.translator
    calls = []  # (start, seconds) of each generate() call: a fixed batch each (a stream is one call throughout)
    generate = translator.generator.generate

    def timed_generate(*inputs, **options):
        begun = time.perf_counter()
        try:
            return generate(*inputs, **options)
        finally:
            calls.append((begun, time.perf_counter() - begun))

    translator.generator.generate = timed_generate

    lines = [line.strip() for line in open(args.sources, encoding="utf-8") if line.strip()]
    rng = random.Random(args.seed)
    sources = [translator.sources([rng.choice(lines)])[0] for _ in range(WARM_UP + args.sentences)]
    latencies = [None] * len(sources)
    answered, lock, remaining = threading.Event(), threading.Lock(), [len(sources)]

    def on_answer(index, due):
        def answer(_):
            latencies[index] = time.perf_counter() - due
            with lock:
                remaining[0] -= 1
                if not remaining[0]:
                    answered.set()
        return answer

    start = time.perf_counter()
    arrivals = [start + offset for offset in poisson_schedule(args.rate, len(sources), rng)]
    measured_from = arrivals[WARM_UP]
    for index, (source, due) in enumerate(zip(sources, arrivals)):
        time.sleep(max(0.0, due - time.perf_counter()))
        batching.submit([Job(source, on_answer(index, due))])
    answered.wait()
    wall = time.perf_counter() - measured_from
    batching.stop()

    measured = latencies[WARM_UP:]
    print(f"{server_args.batching} batching, {args.rate:g} sentences/s, {args.sentences} sentences: latency p50 "
          f"{percentile_ms(measured, 50):.0f} p90 {percentile_ms(measured, 90):.0f} "
          f"p99 {percentile_ms(measured, 99):.0f} ms "
          f"({time.perf_counter() - start:.0f} s in all)")
    if server_args.batching == "fixed":
        batches = [seconds for begun, seconds in calls if begun >= measured_from]
        print(f"fixed batches: {len(batches)}, {sum(batches) / wall:.0%} of the time busy")
    log.report(measured_from, wall)


if __name__ == "__main__":
    main()
