"""Measure one configuration: a warm-up pass (outputs, statistics, peak memory), then timed passes."""

import time
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, List, Optional

import torch

from fairseq_fastgen.bench.memory import PeakMemory
from fairseq_fastgen.bench.options import BenchConfig


class FairseqCandidate:
    """A generator built by ``task.build_generator``: stock fairseq or a plugin decoder."""

    def __init__(self, task, models, generator, prefix_size: int):
        self.task = task
        self.models = models
        self.generator = generator
        self.prefix_size = prefix_size

    def decode(self, batches) -> Dict[int, torch.Tensor]:
        """Best hypothesis (tokens ending in eos) of every sentence, by sentence id."""
        best = {}
        for sample in batches:
            prefix_tokens = sample["target"][:, : self.prefix_size] if self.prefix_size > 0 else None
            hypotheses = self.task.inference_step(self.generator, self.models, sample, prefix_tokens=prefix_tokens)
            for sentence_id, sentence_hypotheses in zip(sample["id"].tolist(), hypotheses):
                best[sentence_id] = sentence_hypotheses[0]["tokens"]
        return best

    def statistics(self) -> dict:
        counters = getattr(self.generator, "counters", None)
        return counters.as_dict() if counters is not None else {}


@dataclass
class ConfigResult:
    config: BenchConfig
    skipped: Optional[str] = None  # the reason, when the configuration does not apply
    outputs: Dict[int, List[int]] = field(default_factory=dict)  # sentence id -> best tokens, eos included
    seconds: List[float] = field(default_factory=list)  # one per timed pass
    memory: dict = field(default_factory=dict)
    statistics: dict = field(default_factory=dict)  # decoder counters of the warm-up pass
    bleu: Optional[float] = None
    reference: Optional[str] = None  # label of the configuration compared against
    identical_rate: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.skipped is None

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs.values())

    def rate(self, count: int) -> Dict[str, float]:
        """``count`` per second: median, min and max over the timed passes."""
        rates = [count / seconds for seconds in self.seconds]
        return {"median": median(rates), "min": min(rates), "max": max(rates)}

    def sentences_per_second(self) -> Dict[str, float]:
        return self.rate(len(self.outputs))

    def tokens_per_second(self) -> Dict[str, float]:
        return self.rate(self.tokens)


def measure(config, candidate, batches, repeat: int, cuda: bool, progress) -> ConfigResult:
    """One warm-up pass, then ``repeat`` timed passes over ``batches``.

    A ValueError from the warm-up (the decoder refuses this model or these
    options) propagates: the caller reports the configuration as skipped.
    """
    with PeakMemory(cuda) as memory:
        outputs = candidate.decode(batches)
        _synchronize(cuda)
    result = ConfigResult(
        config,
        outputs={i: tokens.tolist() if torch.is_tensor(tokens) else list(tokens) for i, tokens in outputs.items()},
        memory=memory.report,
        statistics=candidate.statistics(),
    )
    progress.update()
    for _ in range(repeat):
        _synchronize(cuda)
        start = time.perf_counter()
        candidate.decode(batches)
        _synchronize(cuda)
        result.seconds.append(time.perf_counter() - start)
        progress.update()
    return result


def _synchronize(cuda: bool):
    if cuda:
        torch.cuda.synchronize()
