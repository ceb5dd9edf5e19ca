"""Statistics every decoder reports (printed by fairseq-generate, saved as JSON)."""

import json
from collections import Counter
from typing import Optional

from fairseq_fastgen.safe_files import write_atomically


FEWER_THAN_NBEST = "sentences_short_of_nbest"  # sentences that ended with fewer hypotheses than --nbest


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

    def nbest_shortfall(self, nbest: int) -> Optional[str]:
        """One line saying how many sentences got fewer than ``nbest`` hypotheses, or None if none did."""
        short = self.counts[FEWER_THAN_NBEST]
        if not short:
            return None
        return (f"--decoder {self.decoder_name}: {short} of {self.counts['sentences']} sentences got fewer than "
                f"--nbest {nbest} hypotheses (a variable-width beam can end with fewer candidates; stock beam search, "
                f"--decoder beam, fills every n-best)")

    def write_json(self, path):
        text = json.dumps(self.as_dict(), indent=2)
        write_atomically(path, lambda f: f.write(text.encode()))
