"""The server's counters, gauges and latency histogram, in Prometheus' text format (``GET /metrics``).

Written by hand (a few dozen lines) rather than with a client library: the format is plain text (version 0.0.4:
``# HELP``, ``# TYPE``, then ``name{label="value"} number`` lines; a histogram's cumulative ``_bucket`` lines,
``_sum`` and ``_count``).  Both the event loop and the decoding thread write here: one lock.
"""

import math
import threading
from typing import Dict, Tuple

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds

# name -> (type, help)
METRICS = {
    "fastgen_serve_requests_total": ("counter", "HTTP responses of POST /translate, by status code"),
    "fastgen_serve_refused_total": ("counter", "requests refused before any of their sentences was decoded, by "
                                                "reason"),
    "fastgen_serve_sentences_total": ("counter", "sentences answered"),
    "fastgen_serve_removed_sentences_total": ("counter", "sentences that left unanswered (their request's deadline, "
                                                         "its client disconnecting, the grace period ending), by "
                                                         "reason and by where they were: waiting in the queue or "
                                                         "decoding in the batch"),
    "fastgen_serve_queue_sentences": ("gauge", "sentences waiting for a place in the batch"),
    "fastgen_serve_batch_sentences": ("gauge", "sentences decoding in the batch"),
    "fastgen_serve_batch_rows": ("gauge", "rows of the running batch's model calls, padding rows included"),
    "fastgen_serve_iterations_total": ("counter", "decoding iterations (model steps of the batch)"),
    "fastgen_serve_request_seconds": ("histogram", "time from a request's arrival to its answer (200 only)"),
}


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.values: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
        self.histograms = {name: Histogram(LATENCY_BUCKETS) for name, (kind, _) in METRICS.items()
                           if kind == "histogram"}
        for name, (kind, _) in METRICS.items():
            if kind in ("gauge",) or name in ("fastgen_serve_sentences_total", "fastgen_serve_iterations_total"):
                self.values[(name, ())] = 0

    def inc(self, name: str, amount: float = 1, **labels):
        key = (name, tuple(sorted(labels.items())))
        with self.lock:
            self.values[key] = self.values.get(key, 0) + amount

    def set(self, name: str, value: float):
        with self.lock:
            self.values[(name, ())] = value

    def observe(self, name: str, value: float):
        with self.lock:
            self.histograms[name].observe(value)

    def get(self, name: str, **labels) -> float:
        with self.lock:
            return self.values.get((name, tuple(sorted(labels.items()))), 0)

    def text(self) -> str:
        lines = []
        with self.lock:
            for name, (kind, help_text) in METRICS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    lines += self.histograms[name].lines(name)
                    continue
                for (key, labels), value in sorted(self.values.items()):
                    if key == name:
                        lines.append(f"{name}{format_labels(labels)} {format_number(value)}")
        return "\n".join(lines) + "\n"


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float):
        self.sum += value
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
                break

    def lines(self, name):
        lines, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        return lines + [f"{name}_sum {format_number(self.sum)}", f"{name}_count {cumulative}"]


def format_labels(labels) -> str:
    if not labels:
        return ""
    escape = lambda value: str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels) + "}"


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse(text: str) -> Dict[str, float]:
    """``GET /metrics``'s text as {'name{labels}': value} (for tests and the load generator)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
