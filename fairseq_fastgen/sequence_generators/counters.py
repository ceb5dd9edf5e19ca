"""Statistics every decoder reports (printed by fairseq-generate, saved as JSON)."""

import json
from collections import Counter


class GenerationCounters:
    """Named integer counters plus derived ratios.

    Every decoder counts ``sentences``, ``tokens`` (generated, eos included),
    ``iterations`` (search steps) and ``model_calls`` (decoder invocations);
    decoders add their own (``candidate_expansions``, ``refills``, ...).
    """

    def __init__(self, decoder_name):
        self.decoder_name = decoder_name
        self.counts = Counter()
        self.per_step = {}  # name -> list of per-step values (e.g. expansions per step)
        self.stats_sources = []  # callables returning more statistics (e.g. the cluster projection's)

    def add(self, name, value=1):
        self.counts[name] += int(value)

    def record_step(self, name, value):
        self.per_step.setdefault(name, []).append(value)
        self.counts[name] += int(value)

    def as_dict(self):
        stats = {"decoder": self.decoder_name, **self.counts}
        if self.counts["iterations"]:
            stats["tokens_per_iteration"] = self.counts["tokens"] / self.counts["iterations"]
        for name, values in self.per_step.items():
            stats[f"{name}_per_step"] = sum(values) / len(values) if values else 0.0
        stats.update(self.extra_stats())
        for source in self.stats_sources:
            stats.update(source())
        return stats

    def extra_stats(self):
        return {}

    def summary(self):
        parts = []
        for key, value in self.as_dict().items():
            if key == "decoder":
                continue
            parts.append(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")
        return f"decoder {self.decoder_name}: " + ", ".join(parts)

    def write_json(self, path):
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=2)
