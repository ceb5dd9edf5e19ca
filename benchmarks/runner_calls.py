"""Where one fairseq-generate run's time goes on ``--step-engine static``: the runner's calls timed one by one.

    python benchmarks/runner_calls.py DATA_BIN --path CKPT --beam 1 --batch-size 16 --step-engine static \
        --decoder greedy-stream --stream-join-lengths --stream-eps 0.9375 --quiet [any fairseq-generate option]

Runs fairseq-generate in this process with ``--user-dir fairseq_fastgen`` and ``--cpu`` added, each call of
the static engine's runner (``StaticRunner``; the compiled engine's own steps are not timed) timed: the encoder
(``encode``), a step (``step``: the projection and log-softmax included; ``step_rows``: the same for rows at their
own positions, ``step_block`` its model part), the projection alone (``project``).  Prints the whole run's seconds,
each method's seconds and calls, and of the model steps: the rows a call holds (mean, median), the positions its
rows attend (the cache's length: the span since the oldest row's first position) and the source width, the mean
and median milliseconds of a call, and for calls of the most frequent row count a least-squares fit of a call's
cost to the attended positions and source width, with the median cost by span.  A measuring aid only: the wrappers
are installed by this script, never by the plugin; one run at a time, nothing else running beside it.
"""

import collections
import statistics
import sys
import time

import numpy as np

from fairseq_fastgen.engine import runners

TIMED = ("encode", "step", "step_rows", "step_block", "project")
calls = collections.defaultdict(list)  # method -> [seconds of each call]
steps = []  # (rows, attended positions, source width, seconds) of each model step on a started cache


def timed(method_name):
    method = getattr(runners.StaticRunner, method_name)

    def call(self, *args, **kwargs):
        cache = args[-1] if method_name in ("step", "step_block") else None
        started = cache is not None and cache.started
        shape = (args[0].size(0), cache.length, cache.cross_keys[0].size(2)) if started else None
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            calls[method_name].append(seconds)
            if shape is not None:
                steps.append(shape + (seconds,))

    return call


def report(total: float):
    print(f"whole run {total:.2f} s; " + ", ".join(
        f"{name} {sum(times):.2f} s in {len(times)} calls" for name, times in calls.items()))
    if not steps:
        return
    rows, spans, widths, seconds = (np.array(column, dtype=float) for column in zip(*steps))
    model = "step_block" if calls.get("step_block") else "step"
    print(f"{model} on started caches: {len(steps)} calls, rows mean {rows.mean():.1f} median "
          f"{np.median(rows):.0f}; attended positions mean {spans.mean():.1f} median {np.median(spans):.0f} max "
          f"{spans.max():.0f}; source width mean {widths.mean():.1f}; ms a call mean {1000 * seconds.mean():.3f} "
          f"median {1000 * np.median(seconds):.3f}")
    common = statistics.mode(rows.tolist())
    chosen = rows == common
    terms = np.c_[np.ones(chosen.sum()), spans[chosen], widths[chosen]]
    fit = np.linalg.lstsq(terms, 1000 * seconds[chosen], rcond=None)[0]
    print(f"calls of {common:.0f} rows ({chosen.sum()}): ms = {fit[0]:.3f} + {fit[1]:.4f} x positions + "
          f"{fit[2]:.4f} x source width")
    for low, high in ((0, 16), (16, 24), (24, 32), (32, 48), (48, 80), (80, 100000)):
        band = chosen & (spans >= low) & (spans < high)
        if band.any():
            print(f"  positions {low}-{high - 1}: {band.sum()} calls, median {1000 * np.median(seconds[band]):.3f} ms")


def main():
    for method_name in TIMED:
        setattr(runners.StaticRunner, method_name, timed(method_name))
    from fairseq_cli.generate import cli_main

    sys.argv = [sys.argv[0], *sys.argv[1:], "--user-dir", "fairseq_fastgen", "--cpu"]
    start = time.perf_counter()
    cli_main()
    report(time.perf_counter() - start)


if __name__ == "__main__":
    main()
